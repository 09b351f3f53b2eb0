"""Run configuration: msgspec Structs decoded from TOML.

Precedence: defaults < TOML files, left to right < ``--set section.key=value`` overrides. Unknown keys are
errors naming the key path (``trainer.lrr``); cross-field rules name every field involved. Importing this
module never imports torch.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import structlog

from rollflow.errors import ConfigError
from rollflow.messages import sampling_error

log = structlog.get_logger(__name__)

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0, le=1)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: unknown keys are errors, fields are keyword-only."""


class ModelConfig(Section):
    path: str = "rollflow:tiny"
    """``rollflow:tiny`` (built locally), a local Hugging Face model directory, or a name in the local HF cache."""
    renderer: str = "auto"
    """Chat renderer (a ``renderers`` config name such as ``qwen3``, or ``default`` for the tokenizer's chat
    template). ``auto``: qwen3 for ``rollflow:tiny``, otherwise the renderer renderers registers for the model's
    Hugging Face name (taken from the HF cache layout or ``config.json``'s ``_name_or_path``, not the snapshot
    path), else ``default`` with a warning. A run writes the resolved name into its ``config.json``."""
    enable_thinking: bool = False
    """Whether the generation prompt opens a thinking block (renderers that support it)."""


class RewardSpec(Section):
    fn: str
    """A built-in reward (``math``, ``exact``, ``case``) or ``package.module:function``."""
    weight: float = 1.0
    """Its weight in the sum that is the sample's reward."""


class DataConfig(Section):
    task: str = "case"
    """Built-in task (``case``, ``digit``) or ``package.module:factory`` returning a Task; unused with ``path``."""
    path: str | None = None
    """Prompts from a dataset instead of ``task``: a ``.jsonl`` or ``.parquet`` file, a directory (holding
    ``{split}.jsonl`` / ``{split}.parquet``, or saved with HF datasets' ``save_to_disk``), or ``hf:NAME`` from
    the local HF datasets cache (needs ``pip install datasets``)."""
    split: str | None = None
    """Split of a directory or ``hf:`` dataset (unset: ``train``); not for a single file."""
    prompt_key: str = "prompt"
    """Column of the prompt, a dotted path into nested columns: a string (one user message) or a list of
    ``{role, content}`` messages (TRL's conversational format, verl's ``prompt``)."""
    answer_key: str | None = None
    """Column of the reference answer the reward gets as ``item.answer`` (dotted path); unset: ``answer``, else
    verl's ``reward_model.ground_truth``, else none."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A row without a usable prompt or answer, or a prompt (of any task) that cannot fit
    ``inference.max_model_len`` with room for one generated token: ``fail`` (an error naming the row, its
    line for JSONL) or ``skip`` (counted and logged, never silent: a prompt too long is not generated for,
    its group's samples are masked as ``prompt_too_long`` and counted in the ``skipped_prompts`` metric).
    Prompts are measured before they are tokenized: text with more characters than ``max_model_len`` times
    the tokenizer's longest token (x4 for Unicode normalization) cannot fit and is never tokenized."""
    shuffle: bool = True
    """Visit the rows of each epoch in a fresh order seeded by ``seed`` and the epoch (False: file order)."""
    epochs: Positive | None = None
    """Passes over a dataset (``path``); sets the run's length to ``ceil(epochs * rows / prompts_per_step)``
    steps, in place of ``orchestrator.steps``. Every row is trained exactly once per epoch, across resumes."""
    args: dict[str, Any] = {}
    """Keyword arguments for a custom task factory (``[data.args]``): ``factory(seed, **args)``."""
    reward: str | None = None
    """Reward override: a built-in (``math``, ``exact``, ``case``) or ``package.module:function``, sync or
    async, called as ``fn(completion, item)``. Required with ``path`` unless ``rewards`` is set."""
    rewards: list[RewardSpec] = []
    """A weighted sum of rewards, ``[{fn = "math", weight = 1.0}, ...]``; each is logged as ``reward/NAME``."""
    seed: int = 0
    """Seed of the generated prompt stream (or of a dataset's shuffles); the same seed gives the same prompts in
    the same order."""
    reward_timeout_s: PositiveFloat = 60.0
    """Longest one sample's reward may take (with ``rewards``, the whole weighted sum), in seconds. Past it
    the sample is masked (``reward_timeout``), counted in the ``reward_timeouts`` metric and logged; a sync
    reward's thread is left to finish on its own (the run does not wait for it, nor does ``rollflow``'s
    exit), and 64 such calls still running stop the run with an error naming the reward."""
    task_timeout_s: PositiveFloat = 60.0
    """Longest a custom task's ``item(index)`` may take (it runs in a worker thread), in seconds; past it the
    run fails with an error naming the task and the index. Built-in tasks and datasets are lookups and are
    not timed."""


class SamplingConfig(Section):
    samples_per_prompt: Positive = 8
    """Completions sampled per prompt (the group size for GRPO/RLOO baselines)."""
    max_tokens: Positive = 8
    """Completion budget of each sample, in tokens (a completion that reaches it ends with ``length``)."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature, within what the float32 sampler represents: [1e-5, 1e4]
    (``rollflow.messages.sampling_error``; 0, greedy, leaves RL nothing to explore and is refused)."""
    top_p: Probability = 1.0
    """Nucleus mass kept, in [1e-8, 1]; 1 disables it."""
    top_k: int = -1
    """0 or -1 disables top-k filtering; otherwise a positive count."""


class InferenceConfig(Section):
    mode: Literal["local", "http"] = "local"
    """``local``: torch engines in this process. ``http``: engines behind HTTP servers, reached through a
    router (see ``external_proxy_url`` / ``external_server_urls`` for which parts rollflow starts itself).
    The environment variable ``ROLLFLOW_INFERENCE_MODE`` overrides this."""
    engine: Literal["torch", "vllm"] = "torch"
    """Server kind rollflow starts in ``http`` mode: ``torch`` (``rollflow serve``, CPU or GPU) or ``vllm``
    (``vllm serve``; needs ``pip install 'rollflow[vllm]'`` and GPUs)."""
    num_servers: Positive = 2
    """Inference servers rollflow starts in ``http`` mode (unless ``external_server_urls`` are given)."""
    colocate: bool = False
    """Servers share the trainer's device(s) and take turns with it: around each training step they sleep
    (``POST /sleep?level=sleep_level``), then wake in two stages (``/wake_up?tags=weights``, the weight push,
    ``/wake_up?tags=kv_cache``). On GPUs the push is CUDA IPC (``weight_sync.strategy = "auto"``) and vLLM
    servers get ``--enable-sleep-mode``; on CPUs the configured strategy. Only with servers rollflow starts
    (``http`` mode), and only in the ``sync`` and ``one_step`` orchestrator modes."""
    sleep_level: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    """``colocate``: how deeply the servers sleep during a training step. ``1``: the KV cache (and prefix
    cache) is freed and the weights kept (on a GPU, offloaded to CPU memory). ``2``: the weights are freed
    too, and the push after the step reloads them all (cheaper when every step pushes anyway)."""
    tensor_parallel_size: Positive = 1
    """GPUs per server (vLLM ``--tensor-parallel-size``). Managed servers each get their own GPUs through
    ``CUDA_VISIBLE_DEVICES``: server i gets devices ``[i * tp, (i + 1) * tp)`` of those this process sees.
    rollflow's torch engine runs on one device: 1 only."""
    gpu_memory_utilization: Probability | None = None
    """vLLM servers: the fraction of each GPU's memory the server may use (``--gpu-memory-utilization``;
    unset: vLLM's default, 0.9). Lower it when colocated, so the trainer's memory fits next to it. Not for
    the torch engine, which sizes its KV cache from ``max_batch_size`` and ``max_model_len``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype of the servers (vLLM ``--dtype``; ``auto``: the checkpoint's). The torch
    engine computes in float32: ``auto`` or ``float32`` only."""
    server_args: list[str] = []
    """Extra arguments appended to each managed server's command line (``vllm serve …``, or ``rollflow serve``
    for the torch engine), e.g. ``["--enable-prefix-caching", "--seed", "1"]``. Flags rollflow sets itself
    (host, port, model, the keys above) are refused: set their keys instead."""
    external_proxy_url: str | None = None
    """Data-plane URL of a router/proxy rollflow does not manage. Alone, it is also the control plane."""
    external_server_urls: list[str] = []
    """Base URLs of servers rollflow does not manage (the control plane). Without ``external_proxy_url``,
    rollflow starts its own router over them."""
    api_key: str | None = None
    """Bearer token of the inference HTTP layer: rollflow sends ``Authorization: Bearer <api_key>`` to the
    router, proxy and servers, and starts its own servers and router with it (``--api-key``). Unset: the
    environment variable ``ROLLFLOW_API_KEY``, else no key. Prefer the variable: the resolved config, key
    included, is written to the run directory."""
    router: Literal["auto", "always"] = "auto"
    """Whether rollflow starts a router in front of the servers (its own, or ``external_server_urls``).
    ``auto``: only for two or more; the client talks to a single server directly. ``always``: also for one
    (a stable ``router_port`` URL, its health probes and ``/list_workers``)."""
    router_impl: Literal["rollflow", "vllm-router"] = "rollflow"
    """Which router rollflow starts: ``rollflow`` (``rollflow router``: session table, failover retries,
    ``/list_workers``) or ``vllm-router`` (the Rust router from ``pip install vllm-router``, started with
    ``--policy consistent_hash`` on the ``X-Session-ID`` header; it costs less CPU per request). Either way the
    client sends control calls (pause, weight updates …) to every server itself."""
    router_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    """Port of the router rollflow starts (on 127.0.0.1); 0 picks a free port."""
    request_timeout_s: PositiveFloat = 600.0
    """Longest one generate call may take over HTTP, including waiting while the servers are paused."""
    control_timeout_s: PositiveFloat = 300.0
    """Longest one control-plane call (pause, sleep, weight transfer …) to one server may take."""
    startup_timeout_s: PositiveFloat = 300.0
    """Longest the servers rollflow starts may take to become ready."""
    health_check_interval_s: PositiveFloat = 2.0
    """Seconds between the router's health probes (each generates one token); a dead server is taken out
    within this interval."""
    niceness: Annotated[int, msgspec.Meta(ge=0, le=19)] = 0
    """How much lower than rollflow's own the CPU priority of the servers and router it starts is (as in
    ``nice``). On a machine where they share CPU cores with the trainer, a positive value keeps their
    frequent wake-ups from preempting training steps (the slower stage when the async modes overlap)."""
    check_logprobs: bool = True
    """``http`` mode: at start-up, check with two short requests per server that its logprobs are those the
    trainer recomputes (after temperature and top-k/top-p: vLLM's ``--logprobs-mode processed_logprobs``,
    which rollflow passes to the vLLM servers it starts); a server that reports vLLM's default raw logprobs
    fails the run with an error naming the flag (``rollflow.inference.logprob_check``). Turn it off only for
    a server that cannot sample ``n`` one-token completions with ``top_k``."""
    num_engines: Positive = 1
    """``mode = "local"``: torch engines in this process, each its own copy of the model (requests are spread
    over them); ``http`` mode starts ``num_servers`` instead."""
    max_batch_size: Positive = 64
    """Sequences decoded together by one engine (its KV-cache slots)."""
    max_model_len: Positive = 1024
    """Longest prompt + completion an engine accepts, in tokens."""
    http_header_timeout_s: PositiveFloat = 30.0
    """Seconds a client of the HTTP servers rollflow starts (``rollflow serve``, the router, the TITO proxy)
    has to send a request's line and headers, counted from the connection opening or its previous response;
    an idle kept-alive connection is closed after as long. A client past it gets a 408 and is disconnected,
    so stalled connections cannot pile up (``--http-header-timeout-s``). Keep it above the clients' pooled
    connection idle time (aiohttp 15 s, httpx 5 s), or a client may reuse a connection as it is closed."""
    http_body_timeout_s: PositiveFloat = 120.0
    """Seconds such a client has to send a request's body once its headers are in (408 and disconnect
    after; ``--http-body-timeout-s``). The default takes the largest body a server accepts (32 MiB) at a
    quarter of a MB/s."""
    http_max_connections: Positive = 4096
    """Connections each such server serves at once; a connection beyond it gets a 503 and is closed
    (``--http-max-connections``). The servers raise their open-file limit to the hard limit at start."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where rollflow's torch engines run: the in-process ones (``local`` mode) and the ``rollflow serve``
    servers rollflow starts (``--device``). ``auto``: CUDA when torch sees a GPU, else the CPU. Engines
    compute in float32."""
    return_routed_experts: bool = False
    """MoE models: engines return the experts each token was routed to, and agent (TITO) samples carry them
    (``routed_experts``, for routing replay in training). Sets ``return_routed_experts`` on in-process engines
    and ``--enable-return-routed-experts`` on the servers rollflow starts (``rollflow serve`` or ``vllm serve``).
    A dense model with this on fails at start-up."""

    def http_limits(self):
        """``rollflow.inference.http_limits.HttpLimits`` of the ``http_*`` keys."""
        from rollflow.inference.http_limits import HttpLimits

        return HttpLimits(
            header_timeout_s=self.http_header_timeout_s,
            body_timeout_s=self.http_body_timeout_s,
            max_connections=self.http_max_connections,
        )


class TrainerConfig(Section):
    lr: PositiveFloat = 1e-3
    """Peak AdamW learning rate (finite, > 0); see ``lr_schedule``. Like every number in the config, inf and nan
    are refused."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate over the run's ``orchestrator.steps`` training steps, after ``warmup_steps`` of linear
    warm-up from 0 (transformers' ``get_scheduler``): ``constant`` stays at ``lr``, ``linear`` decays to 0,
    ``cosine`` follows half a cosine to 0. Saved in checkpoints, so a resumed run continues it."""
    warmup_steps: NonNegative = 0
    """Training steps of linear warm-up from 0 to ``lr`` (a step's ``ppo_epochs * mini_batches`` optimizer
    updates share its rate)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's model, gradients and optimizer state live. ``auto``: CUDA when torch sees a GPU,
    else the CPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the forward and backward. Weights, gradients and AdamW state stay float32 (master
    weights) either way; ``bfloat16`` runs the forward under ``torch.autocast(bfloat16)`` (matmuls in bf16,
    softmax and norms in float32). ``auto``: bfloat16 on CUDA, float32 on the CPU (where bf16 matmuls are
    slow and the engine/trainer logprob mismatch would grow)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (Hugging Face
    ``gradient_checkpointing_enable``): about a layer's activations instead of all of them, for ~1/3 more
    compute."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moving-average decays, each in [0, 1)."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradients are clipped to this total norm (finite, > 0)."""
    micro_batch_size: Positive = 64
    """Most samples per forward/backward pass; gradients accumulate over a step's micro-batches."""
    micro_batch_tokens: Positive | None = None
    """Token budget of one forward/backward pass: samples of similar length are grouped (longest first) so
    that rows × longest row stays within it, instead of padding every sample to the step's longest. Unset:
    only ``micro_batch_size`` limits a micro-batch. Must hold the longest sample the run can produce
    (``inference.max_model_len``, or ``agent.max_seq_len`` for agents)."""
    num_workers: Positive = 1
    """Data-parallel trainer processes (one torch.distributed group: gloo on CPU, NCCL on GPU, one GPU each);
    the step's samples are split across them by tokens. More than 1 always runs them as processes of their
    own (``placement`` applies to a single trainer)."""
    parallelism: Literal["fsdp2", "ddp"] = "fsdp2"
    """How ``num_workers > 1`` share the model. ``fsdp2``: parameters, gradients and optimizer state sharded
    (``fully_shard`` per decoder layer and the root). ``ddp``: every worker holds the whole model, gradients
    are summed across workers once per step."""
    logprob_chunk_tokens: NonNegative = 1024
    """Token positions whose vocabulary-sized logits are computed at once, in the forward and again in the
    backward (``rollflow.train.losses.chunked_token_logprobs``): the full ``[batch, time, vocab]`` logits
    never exist, which bounds that memory at ``chunk * vocab * 4`` bytes a tensor. 0 computes the full
    logits in one piece (the plain ``lm_head``), e.g. to compare."""
    sampling_mask: Literal["replay", "ignore"] = "replay"
    """What the trainer does with the sampler's top-k/top-p truncation (``sampling.top_k > 0`` or
    ``sampling.top_p < 1``, or an agent's own values); without truncation both are the same. ``replay``: the
    engine records each token's kept set (one int, ``Sample.kept_counts``) and the trainer's logprobs, entropy
    and KL are those of the softmax renormalised over that set, i.e. of the policy that sampled (entropy is
    then the sampler's; ``rollflow.train.losses``); tokens outside the set get no gradient, so what the model
    does without truncation is not trained. ``ignore``: train the full softmax at the temperature, as if
    nothing were cut (the ratio's anchor is moved onto it; entropy is the full softmax's). Servers rollflow does not start must return processed logprobs (vLLM:
    ``--logprobs-mode processed_logprobs``; ``inference.check_logprobs``). vLLM records no kept sets: the
    client fills in ``top_k`` for a top-k-only request, but tokens a vLLM top-p cut are trained on the full
    softmax against a renormalised behaviour logprob (their mismatch shows in ``logprob_mismatch``)."""
    advantage: Literal["grpo", "rloo", "grpo_no_std"] = "grpo"
    """``grpo``: (r - mean) / std within the group; ``grpo_no_std``: r - mean (Dr. GRPO's advantage);
    ``rloo``: leave-one-out mean."""
    ppo_epochs: Positive = 1
    """Passes over each step's batch (PPO's epochs; verl ``ppo_epochs``, TRL ``num_iterations``). Each pass
    takes ``mini_batches`` optimizer updates, so a step takes ``ppo_epochs * mini_batches``. 1 (with
    ``mini_batches = 1``): one update per step, on-policy, where the PPO ratio stays at 1 (up to stale
    samples and engine mismatch) and ``clip_low`` / ``clip_high`` hardly ever act. The ratio is always taken
    against logprobs fixed at the start of the step (see ``off_policy``), so from the second update on it
    measures how far the updates moved the policy and the clip bounds that. The learning-rate schedule
    counts steps, not updates; per-pass metrics are logged as ``ppo_epoch_N/*`` when this is above 1."""
    mini_batches: Positive = 1
    """Optimizer updates per pass over the step's batch: its prompt groups, in batch order, are split into
    this many mini-batches of whole groups (a group's samples are never split across updates; each
    mini-batch is then split across ``num_workers`` ranks and into micro-batches). Must divide
    ``orchestrator.prompts_per_step``. Each update normalises its loss over its own mini-batch (all ranks)
    per ``loss_agg``; 1 trains the whole step at once."""
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"] = "token_mean"
    """How each update's per-token losses become one number (``rollflow.train.aggregation``), over the
    update's mini-batch on all ranks. ``token_mean``: the sum over every loss token divided by their count,
    so every token weighs the same and long completions weigh more (DAPO, Yu et al. 2025).
    ``seq_mean_token_mean``: each sequence's token mean, then the mean over sequences (the original GRPO,
    Shao et al. 2024): a token of a short completion weighs more than one of a long completion.
    ``seq_mean_token_sum``: each sequence's token sum, then the mean over sequences. ``constant``: each
    sequence's token sum divided by ``constant_norm``, then the mean over sequences: Dr. GRPO (Liu et al.
    2025), whose code divides by a fixed MAX_TOKENS rather than by any length, so no length biases the
    gradient. Metrics (clip fraction, ratio, KL, entropy) stay token means whatever this is."""
    constant_norm: PositiveFloat | None = None
    """``loss_agg = "constant"`` only (required there): the constant each sequence's token sum is divided
    by; Dr. GRPO uses the generation budget, ``sampling.max_tokens``."""
    clip_low: NonNegativeFloat = 0.2
    """Lower side of the PPO ratio clip range (see ``clip_high``)."""
    clip_high: NonNegativeFloat = 0.2
    """PPO ratio clip range: [1 - clip_low, 1 + clip_high]; ``clip_high > clip_low`` is DAPO's clip-higher.
    It only acts when the ratio moves away from 1: from the second update of a step on (``ppo_epochs`` or
    ``mini_batches`` above 1), or, with ``off_policy = "none"``, on tokens whose behaviour logprob differs
    from the trainer's (stale samples of the async modes, engine/trainer mismatch). With ``tis`` or
    ``decoupled`` and one update per step the ratio is exactly 1 and the clip never binds."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the initial (reference) policy (estimated per ``kl_estimator``, applied
    per ``kl_in``); 0 disables it and the reference model. The reference is a frozen copy of the initial
    weights (no gradients, no optimizer state, not checkpointed) that doubles the parameter memory: per
    worker with ``num_workers > 1`` (sharded like the policy under ``fsdp2``, a whole replica under ``ddp``)."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_k3"] = "k3"
    """Per-token estimate of KL(policy || reference) from the sampled token's logprobs, with
    ``log_ratio = log pi - log pi_ref`` (Schulman's estimators): ``k1``: ``log_ratio`` (unbiased, can be
    negative); ``k2``: ``log_ratio ** 2 / 2``; ``k3``: ``exp(-log_ratio) + log_ratio - 1`` (unbiased, never
    negative, the GRPO paper's); ``low_var_k3``: k3 with ``log_ratio`` clamped to [-20, 20] and the result
    to [-10, 10], as verl's ``low_var_kl``, so one very unlikely token cannot dominate. Only with
    ``kl_coef > 0``."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes. ``loss``: ``kl_coef * KL`` is added to each token's loss (GRPO), with
    the gradient of the estimator, at the current weights of every update. ``reward``: before the
    advantages, each sample's reward loses ``kl_coef`` times the sum of its tokens' KL, measured with the
    weights at the start of the step (verl's ``use_kl_in_reward``); the advantages are then recomputed per
    group (``advantage``), so the penalty acts through them, and the loss has no KL term. ``reward``
    needs ``kl_coef > 0``."""
    num_threads: Positive | None = None
    """Torch threads of a training step; unset keeps torch's count. When generation shares the cores
    (async modes on one machine), fewer threads than cores lets the two overlap instead of contending."""
    placement: Literal["thread", "process"] = "thread"
    """Where training steps run. ``thread``: a worker thread of the orchestrator's process. ``process``: a
    child process of its own (``rollflow.train.process``), so a step never waits for the interpreter lock
    the event loop holds while it handles generation; worth it in the overlapped modes when the step's
    Python overhead matters (small models, CPU). It adds the child's start-up (importing torch and loading
    the model) to the run's; its weights are shared with the orchestrator through shared memory. The child
    is spawned, so a script that starts a run must guard its entry point (``if __name__ == "__main__":``)."""
    off_policy: Literal["auto", "none", "tis", "decoupled"] = "auto"
    """Correction for tokens sampled by an older policy (``rollflow.train.off_policy``). ``none``: PPO-clip
    directly against the behaviour (sampler) logprobs. ``tis``: PPO-clip against the trainer's own weights
    at the start of the step, each token weighted by ``min(pi_trainer / pi_behaviour, tis_cap)``.
    ``decoupled``: the same objective with the weight uncapped, or with tokens above ``decoupled_cap``
    left out (AReaL's decoupled PPO). ``auto``: ``none`` in ``sync`` mode, ``tis`` in the async modes."""
    tis_cap: PositiveFloat = 2.0
    """``tis``: the truncation C of the importance weight (>= 1, so on-policy tokens keep weight 1)."""
    decoupled_cap: PositiveFloat | None = None
    """``decoupled``: tokens whose importance weight exceeds it are left out of the loss (> 1); unset keeps
    every token at its full weight."""

    def resolved_off_policy(self, orchestrator_mode: str) -> Literal["none", "tis", "decoupled"]:
        """``off_policy`` with ``auto`` resolved for ``orchestrator.mode``; what ``Trainer`` takes."""
        if self.off_policy != "auto":
            return self.off_policy
        return "none" if orchestrator_mode == "sync" else "tis"


class OrchestratorConfig(Section):
    mode: Literal["sync", "one_step", "fully_async"] = "sync"
    """``sync``: generate a step's batch, train on it, update weights. ``one_step``: generate step t + 1 while
    training step t (staleness ≤ 1). ``fully_async``: generation never waits for training, within
    ``max_staleness``."""
    prompts_per_step: Positive = 16
    """Prompts (groups of ``sampling.samples_per_prompt`` samples) trained in each step."""
    steps: Positive = 100
    """Optimizer steps of the run."""
    max_staleness: NonNegative = 2
    """``fully_async``: the most policy versions a trained sample may lag the weights being trained (checked
    per sample; staler groups are dropped and regenerated). ``sync`` uses 0 and ``one_step`` 1."""
    max_inflight: Positive = 64
    """Prompt groups generating at once (bounds the generation channel and the engines' queue)."""
    barrier: Literal["abort", "wait", "keep"] = "keep"
    """How a weight update treats requests in flight (async modes): ``abort`` them (see
    ``partial_rollouts``), ``wait`` for them to finish, or ``keep`` them frozen and continue on the new
    weights (their tokens then carry two policy versions)."""
    partial_rollouts: bool = True
    """After an ``abort``, continue the request from its partial tokens on the new weights (True), or throw
    the partial tokens away and sample the completion again (False)."""
    max_masked_steps: NonNegative = 3
    """Steps in a row with every sample masked (rewards that fail or time out, prompts too long, failed
    agents) after which the run stops with an error counting the reasons, instead of running to the end
    having trained nothing; 0 never stops."""


class CheckpointConfig(Section):
    every: NonNegative = 0
    """Save a checkpoint every N steps (0: only at the end of the run)."""
    keep: Positive = 2
    """Most recent checkpoints kept on disk."""


class WeightSyncConfig(Section):
    strategy: Literal["auto", "local", "broadcast", "checkpoint", "cuda_ipc"] = "auto"
    """How new weights reach the engines. ``auto``: ``local`` (in-process copy) in local mode, ``broadcast``
    (torch.distributed: gloo on CPU, NCCL on GPU) in http mode. ``checkpoint``: safetensors through
    ``checkpoint_dir`` or over HTTP. ``cuda_ipc``: colocated GPUs."""
    timeout_s: PositiveFloat = 300.0
    """Longest a weight-update barrier (pause, transfer, resume) may take before the run fails loudly."""
    bucket_size_mb: PositiveFloat = 256.0
    """Size of the packed buffers a broadcast sends (broadcast and cuda_ipc)."""
    backend: Literal["gloo", "nccl"] | None = None
    """Broadcast backend; unset picks NCCL when CUDA is available, else gloo."""
    master_address: str = "auto"
    """Address trainer rank 0 binds its rendezvous on (broadcast store, checkpoint HTTP server), which the
    inference servers connect to; ``0.0.0.0`` binds every interface and advertises the trainer host's address.
    ``auto``: 127.0.0.1 with ``cluster.backend = "local"``, the address of trainer rank 0's node on Ray."""
    checkpoint_dir: str | None = None
    """Directory shared with the servers for the checkpoint strategy; unset sends the file over HTTP."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """What the trainer casts floating weights to before they travel (broadcast, checkpoint, cuda_ipc): the
    inference engines' dtype halves the bytes of an fp32 trainer feeding bf16 engines. ``auto``: as the
    trainer holds them (the engines cast on load)."""

    def resolved_strategy(self, inference_mode: str) -> str:
        if self.strategy != "auto":
            return self.strategy
        return "local" if inference_mode == "local" else "broadcast"

    def strategy_options(
        self, strategy: str, engine: str = "torch", rank0_address: str = "127.0.0.1"
    ) -> dict[str, Any]:
        """Keyword options of ``rollflow.weights.create_strategy`` for the (resolved) ``strategy``, sending to
        servers of kind ``engine`` (``inference.engine``: vLLM takes only its own payload keys);
        ``rank0_address`` (trainer rank 0's node) stands for ``master_address = "auto"``."""
        from rollflow.weights.registry import strategy_options

        master_address = rank0_address if self.master_address == "auto" else self.master_address
        return strategy_options(strategy, self, engine=engine, master_address=master_address)


class ClusterConfig(Section):
    """Where the run's processes run (``rollflow.launch``): on this machine, or placed on a Ray cluster."""

    backend: Literal["local", "ray"] = "local"
    """``local``: engine servers, router and trainer workers are subprocesses of this one. ``ray``: engine
    servers and trainer workers run as Ray actors placed by a placement plan (``rollflow run --dry-run``
    prints it); the orchestrator, the router and the client stay here and reach the servers by URL. Needs
    ``pip install 'rollflow[ray]'``."""
    address: str = "local"
    """The Ray cluster: ``local`` starts a private Ray instance on this machine for the run; ``auto`` joins
    the cluster this machine belongs to (``ray start --head`` / ``ray start --address``); ``HOST:PORT`` or
    ``ray://HOST:PORT`` joins the one there."""
    placement_timeout_s: PositiveFloat = 180.0
    """Longest the run waits for the cluster to grant its placement groups (a multi-node start takes about a
    minute); then it fails with what was asked, what the cluster has and the keys to change."""
    env: dict[str, str] = {}
    """Environment variables set in every actor (trainer workers, server launchers, and so the servers)."""
    forward_env: list[str] = msgspec.field(default_factory=lambda: ["NCCL_*", "GLOO_*", "HF_*"])
    """Variables of this process's environment forwarded into every actor, as names or ``fnmatch`` patterns
    (the network interfaces NCCL and gloo bind, the Hugging Face cache); ``env`` wins over them."""
    cpus_per_worker: PositiveFloat = 1.0
    """Ray CPUs reserved for each trainer worker (its bundle: these CPUs, and one GPU when it trains on GPUs)."""
    cpus_per_server: PositiveFloat = 1.0
    """Ray CPUs reserved for each engine server (its bundle: these CPUs and its tensor-parallel GPUs)."""
    num_cpus: Positive | None = None
    """``address = "local"``: CPUs of the private Ray instance (unset: Ray counts this machine's)."""


class LoggingConfig(Section):
    """Where step metrics go besides ``{run_dir}/metrics.jsonl``, which is always written (resume and
    ``rollflow plot`` read it)."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = msgspec.field(
        default_factory=lambda: ["jsonl"]
    )
    """Metric sinks: ``tensorboard`` (event files in ``{run_dir}/tensorboard``; needs the ``tensorboard``
    package), ``wandb`` (a run in ``{run_dir}/wandb``; ``pip install wandb``), ``mlflow`` (a run in the
    ``logging.mlflow_tracking_uri`` store; ``pip install mlflow``)."""
    samples_every: NonNegative = 0
    """Every N steps, log a table of sampled completions (prompt index, reward, completion) to the backends
    that show tables (tensorboard text, wandb table, mlflow table); 0: never. ``rollouts.jsonl`` has them all."""
    samples_max: Positive = 16
    """Rows in each samples table (the first samples of the step)."""
    wandb_project: str = "rollflow"
    """The wandb project; the wandb run is named after the rollflow run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: written under ``{run_dir}/wandb`` only (upload later with ``wandb sync``), as on clusters
    without network; ``online`` streams to the wandb server (needs ``wandb login``)."""
    mlflow_tracking_uri: str | None = None
    """The mlflow tracking store (a server URL or database URI); unset: SQLite at ``{run_dir}/mlflow.db``, artifacts
    in ``{run_dir}/mlartifacts`` (view with ``mlflow ui --backend-store-uri sqlite:///{run_dir}/mlflow.db``)."""
    mlflow_experiment: str = "rollflow"
    """The mlflow experiment; the mlflow run is named after the rollflow run."""
    prometheus_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    """Serve the latest step's metrics for Prometheus at ``http://{prometheus_host}:{port}/metrics`` while the
    run lives (``rollflow_<metric>`` gauges, read at scrape time; ``pip install prometheus_client``); 0 picks a
    free port (logged). Unset: no endpoint. The engine servers and the router have their own ``/metrics``."""
    prometheus_host: str = "127.0.0.1"
    """Interface of the orchestrator's Prometheus endpoint; another than loopback exposes it to the network."""


class AgentConfig(Section):
    """Agent rollouts through the TITO proxy; when this section is present it replaces single-turn generation.
    The group size is ``sampling.samples_per_prompt``; requests default to ``sampling.max_tokens`` and
    ``sampling.temperature``."""

    callable: str | None = None
    """Async ``agent(base_url, task) -> reward``: ``package.module:function`` or ``path/to/file.py:function``."""
    command: str | list[str] | None = None
    """Or a command run per trajectory (argument list, or a shell string) with ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` set and the task as JSON on stdin; it prints the reward as the
    last line of stdout."""
    env: dict[str, str] = {}
    """Extra environment variables for ``command``."""
    mode: Literal["per_branch", "single_branch", "step_wise"] = "per_branch"
    """How a trajectory's message tree becomes samples (see ``rollflow.tito.composer``)."""
    composer: str | None = None
    """A custom composer, ``package.module:function``, called like ``rollflow.tito.compose``."""
    max_seq_len: Positive | None = None
    """Longest training sample in tokens (required): longer ones are cut, or masked with ``filter_overlong``."""
    filter_overlong: bool = False
    """A sample longer than ``max_seq_len`` is masked (kept with no trainable token, counted) instead of cut
    to ``max_seq_len``."""
    timeout_s: PositiveFloat = 300.0
    """Longest one trajectory may run; a timed-out trajectory is masked and counted as a timeout."""
    max_concurrent: Positive | None = None
    """Most trajectories running at once over all prompts (unset: no limit of its own)."""
    enforce_sampling: bool = True
    """Sample every agent request at ``sampling.temperature``, ``sampling.top_p`` and ``sampling.top_k``
    whatever it asks, and without its ``min_p``, ``repetition_penalty``, penalties or ``logit_bias`` (the
    trainer's PPO ratio assumes the run's distribution); requests that asked otherwise are counted as
    ``agent_sampling_overridden``. False honours the agent's own temperature, top_p and top_k (e.g.
    generate-only evaluation) and refuses the others, which the engines do not implement."""
    strict_requests: bool = False
    """Refuse (HTTP 400 naming the field) request fields the proxy does not know and values it cannot
    enforce (``tool_choice: "required"``). False ignores them, as vLLM does, and counts them
    (``agent_unknown_fields``, ``agent_ignored_values``)."""
    host: str = "127.0.0.1"
    """Interface the TITO proxy listens on. Agents in containers or on other hosts need one they can reach
    (``0.0.0.0`` for all); each session's unguessable URL path is its credential, so expose it only on
    networks you trust."""
    advertise_url: str | None = None
    """Base URL agents are given for the proxy (``http://proxy-host:port``), when they reach it by another
    address than ``host`` (a container network, a port mapping). Unset: ``http://{host}:{port}``."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port the TITO proxy listens on; 0 picks a free one (set it when ``advertise_url`` names a port)."""
    proxy_workers: NonNegative = 0
    """Run the TITO proxy in N worker processes (0: in the run's process). Each worker listens on a port of its
    own (a free one; with one worker, ``port``) and serves the sessions opened on it, a new session going to
    the one with the fewest open; the run's process only answers their generate calls. Raise it when agents'
    turns outrun one event loop, above all with the engines in the run's process (``inference.mode =
    "local"``), where the proxy's HTTP, rendering and parsing share one interpreter with them. Streamed
    requests stream through the workers too. Above 1, ``port`` must be 0 and ``advertise_url`` unset."""
    max_sessions: Positive = 10_000
    """Most agent sessions the TITO proxy holds open at once (each holds its trace, a few KB, until it is
    closed); opening one more is refused: HTTP 429 ``too_many_sessions`` from ``rollflow proxy``'s ``POST
    /sessions``, a ``RequestError`` in a run. With ``proxy_workers`` it bounds the sessions of all workers
    together. Raise it when more agents run at once."""
    session_idle_timeout_s: PositiveFloat = 3600.0
    """Seconds an agent session may go without a request in flight before the TITO proxy closes it as timed
    out (its trace sealed, its URL answering 409 that it expired), so sessions nobody closes do not pile up.
    In a run, ``timeout_s`` ends each trajectory's session sooner; set this above the longest pause an agent
    makes between two requests."""
    save_traces: Literal["none", "sampled", "all"] = "none"
    """Keep agent sessions' message trees with the run, in ``{run_dir}/traces/step_NNNNNN.jsonl`` (one JSON
    trace per line: branches, each turn's render outcome and reason, fork points, per-token policy versions,
    reward); ``rollflow trace RUN`` renders one as an HTML page. ``sampled``: the first trajectory of each
    prompt's group; ``all``: every trajectory."""


class EvalConfig(Section):
    """Held-out evaluation on the run's engines: before training, every ``every`` steps and after the last
    step (``eval/*`` metrics); ``rollflow eval CONFIG --checkpoint RUN`` does the same offline."""

    path: str | None = None
    """Held-out dataset (same forms and keys as ``data.path``); unset: ``data.path`` with ``split``, or for a
    generated task (``data.task``) its prompt stream under ``seed``."""
    split: str | None = None
    """Split of ``path`` (or of ``data.path`` when ``path`` is unset), e.g. ``test``."""
    seed: int | None = None
    """Generated tasks: the seed of the held-out prompt stream (unset: ``data.seed + 1``)."""
    num_prompts: Positive = 64
    """Prompts evaluated: the first N of the held-out set, in file order."""
    every: NonNegative = 0
    """Evaluate every N steps (0: only before training and after the last step)."""
    greedy: bool = True
    """One greedy completion per prompt: ``eval/greedy/reward_mean`` and ``eval/greedy/accuracy``."""
    samples: NonNegative = 0
    """Sampled completions per prompt (0: none): ``eval/sampled/reward_mean``, ``eval/sampled/pass@1`` and
    ``eval/sampled/pass@k`` with k = ``samples``."""
    temperature: NonNegativeFloat | None = None
    """Temperature of the sampled completions (unset: ``sampling.temperature``)."""
    max_tokens: Positive | None = None
    """Completion budget (unset: ``sampling.max_tokens``)."""
    pass_threshold: float = 1.0
    """A completion counts as correct (accuracy, pass@k) when its reward is at least this."""


class RunConfig(Section):
    name: str = "run"
    """Run name; the run directory is ``{output_dir}/{name}``, so one path component (not ``.`` or ``..``).
    One live run per run directory (``{run_dir}/run.lock``)."""
    output_dir: str = "runs"
    """Directory holding the run directories (relative to the working directory)."""
    seed: int = 0
    """Seeds the trainer and the samplers."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    agent: AgentConfig | None = None
    """Agent rollouts (``[agent]``); unset: single-turn generation."""
    eval: EvalConfig | None = None
    """Held-out evaluation (``[eval]``); unset: none during training."""

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def _cross_field_errors(config: RunConfig) -> list[str]:
    errors = []
    if not _RUN_NAME.fullmatch(config.name) or config.name in (".", ".."):
        errors.append(
            f"name = {config.name!r} must be a plain directory name (letters, digits, '.', '_', '-'; not "
            "empty, '.' or '..'): the run directory is {output_dir}/{name}"
        )
    if config.trainer.advantage == "rloo" and config.sampling.samples_per_prompt < 2:
        errors.append(
            "trainer.advantage = 'rloo' needs sampling.samples_per_prompt >= 2 "
            f"(got {config.sampling.samples_per_prompt}): the leave-one-out baseline needs another sample"
        )
    if config.sampling.max_tokens >= config.inference.max_model_len:
        errors.append(
            f"sampling.max_tokens ({config.sampling.max_tokens}) must be smaller than "
            f"inference.max_model_len ({config.inference.max_model_len}) to leave room for the prompt"
        )
    if config.sampling.temperature == 0:
        errors.append(
            "sampling.temperature = 0 samples greedily, which leaves no exploration for RL and no "
            "sampling distribution for the PPO ratio; use a temperature > 0 (1.0 is usual)"
        )
    errors += _data_errors(config)
    errors += _numeric_errors(config)
    errors += _off_policy_errors(config)
    errors += _trainer_errors(config)
    errors += _inference_errors(config.inference)
    errors += _server_option_errors(config.inference)
    errors += _colocation_errors(config)
    errors += _agent_errors(config)
    errors += _cluster_errors(config)
    strategy = config.weight_sync.resolved_strategy(config.inference.mode)
    if (strategy == "local") != (config.inference.mode == "local"):
        errors.append(
            f"weight_sync.strategy = {config.weight_sync.strategy!r} does not fit inference.mode = "
            f"{config.inference.mode!r}: 'local' copies weights into in-process engines and is the only "
            "strategy for local mode; http mode needs 'broadcast', 'checkpoint' or 'cuda_ipc' (or 'auto')"
        )
    if config.inference.engine == "vllm" and strategy == "checkpoint":
        errors.append(
            "weight_sync.strategy = 'checkpoint' cannot reach vLLM servers (inference.engine = 'vllm'), which "
            "receive weights by NCCL or CUDA IPC; use 'broadcast' (or 'auto') or 'cuda_ipc'"
        )
    if config.inference.engine == "vllm" and strategy == "broadcast" and config.weight_sync.backend == "gloo":
        errors.append(
            "weight_sync.backend = 'gloo' cannot reach vLLM servers (inference.engine = 'vllm'), which receive "
            "a broadcast by NCCL only; set weight_sync.backend = 'nccl' or leave it unset"
        )
    return errors


def _data_errors(config: RunConfig) -> list[str]:
    data = config.data
    errors = []
    if data.reward is not None and data.rewards:
        errors.append(
            f"data.reward = {data.reward!r} and data.rewards are both set: use one (data.rewards = "
            "[{fn = ..., weight = ...}] for a weighted sum)"
        )
    for index, part in enumerate(data.rewards):
        if not math.isfinite(part.weight):
            errors.append(f"data.rewards[{index}].weight = {part.weight} must be a finite number")
    if data.epochs is not None and data.path is None:
        errors.append(
            f"data.epochs = {data.epochs} counts passes over a dataset: set data.path, or use "
            "orchestrator.steps for a generated task"
        )
    evaluation = config.eval
    if evaluation is not None:
        if config.agent is not None:
            errors.append("[eval] evaluates single-turn generation; it does not run [agent] rollouts yet")
        if evaluation.path is None and data.path is not None and evaluation.split in (None, data.split):
            errors.append(
                f"[eval] would evaluate the training data (data.path = {data.path!r}, split "
                f"{data.split or 'train'!r}): set eval.path to a held-out file or eval.split to another split"
            )
        if not evaluation.greedy and evaluation.samples == 0:
            errors.append("[eval] with eval.greedy = false and eval.samples = 0 evaluates nothing: set one")
        if evaluation.max_tokens is not None and evaluation.max_tokens >= config.inference.max_model_len:
            errors.append(
                f"eval.max_tokens ({evaluation.max_tokens}) must be smaller than inference.max_model_len "
                f"({config.inference.max_model_len}) to leave room for the prompt"
            )
        if not math.isfinite(evaluation.pass_threshold):
            errors.append(f"eval.pass_threshold = {evaluation.pass_threshold} must be a finite number")
        if evaluation.temperature is not None and evaluation.temperature == 0 and evaluation.samples > 0:
            errors.append("eval.temperature = 0 makes every sampled completion the greedy one; use > 0")
        temperature = (
            config.sampling.temperature if evaluation.temperature is None else evaluation.temperature
        )
        problem = sampling_error(max_tokens=1, temperature=temperature, top_p=1.0, top_k=-1)
        if problem is not None:
            errors.append(f"eval.{problem[1]}")
    if data.args and data.path is not None:
        errors.append("[data.args] is for custom task factories (data.task), not for a dataset (data.path)")
    return errors


def _trainer_errors(config: RunConfig) -> list[str]:
    trainer = config.trainer
    errors = []
    if trainer.micro_batch_tokens is not None:
        if config.agent is not None and config.agent.max_seq_len is not None:
            longest, key = config.agent.max_seq_len, "agent.max_seq_len"
        else:
            longest, key = config.inference.max_model_len, "inference.max_model_len"
        if trainer.micro_batch_tokens < longest:
            errors.append(
                f"trainer.micro_batch_tokens = {trainer.micro_batch_tokens} is smaller than the longest sample "
                f"the run can produce ({key} = {longest}): no micro-batch could hold it; raise "
                f"trainer.micro_batch_tokens to at least {longest} or lower {key}"
            )
    prompts = config.orchestrator.prompts_per_step
    if prompts % trainer.mini_batches:
        errors.append(
            f"trainer.mini_batches = {trainer.mini_batches} does not divide orchestrator.prompts_per_step = "
            f"{prompts}: mini-batches are whole prompt groups ({prompts} % {trainer.mini_batches} = "
            f"{prompts % trainer.mini_batches}); pick a divisor of {prompts}"
        )
    if trainer.loss_agg == "constant" and trainer.constant_norm is None:
        errors.append(
            "trainer.loss_agg = 'constant' divides each sequence's token sum by trainer.constant_norm, which is "
            "unset; set it (Dr. GRPO uses the generation budget, sampling.max_tokens)"
        )
    if trainer.loss_agg != "constant" and trainer.constant_norm is not None:
        errors.append(
            f"trainer.constant_norm = {trainer.constant_norm} only applies to trainer.loss_agg = 'constant' "
            f"(got {trainer.loss_agg!r}); unset it or set trainer.loss_agg = 'constant'"
        )
    if trainer.kl_in == "reward" and trainer.kl_coef == 0:
        errors.append(
            "trainer.kl_in = 'reward' with trainer.kl_coef = 0 puts no penalty in the reward; set "
            "trainer.kl_coef > 0 (e.g. 0.001) or leave trainer.kl_in = 'loss'"
        )
    return errors


def _off_policy_errors(config: RunConfig) -> list[str]:
    trainer = config.trainer
    off_policy = trainer.resolved_off_policy(config.orchestrator.mode)
    errors = []
    if trainer.tis_cap < 1:
        errors.append(
            f"trainer.tis_cap = {trainer.tis_cap} is below 1: it would down-weight on-policy tokens too "
            "(their weight is 1); use a cap >= 1 (2.0 is usual)"
        )
    if trainer.decoupled_cap is not None:
        if trainer.decoupled_cap <= 1:
            errors.append(
                f"trainer.decoupled_cap = {trainer.decoupled_cap} must be > 1: tokens above it are left out, "
                "and on-policy tokens have weight 1"
            )
        if off_policy != "decoupled":
            errors.append(
                f"trainer.decoupled_cap is set but trainer.off_policy = {trainer.off_policy!r} resolves to "
                f"{off_policy!r} for orchestrator.mode = {config.orchestrator.mode!r}; it only applies to "
                "off_policy = 'decoupled' (for 'tis' set trainer.tis_cap)"
            )
    return errors


def _non_finite(value: Any, key: str) -> list[str]:
    """Keys under ``value`` (a section, a list or a number) holding inf or NaN."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [key]
    if isinstance(value, msgspec.Struct):
        return [
            bad
            for name in value.__struct_fields__
            for bad in _non_finite(getattr(value, name), f"{key}.{name}")
        ]
    if isinstance(value, list | tuple):
        return [bad for index, item in enumerate(value) for bad in _non_finite(item, f"{key}[{index}]")]
    return []


def _numeric_errors(config: RunConfig) -> list[str]:
    """Numbers the sampler or the optimizer cannot use: inf or NaN anywhere (TOML spells them ``inf``, ``nan``),
    sampling values outside the float32 sampler's bounds, Adam betas outside [0, 1)."""
    errors = []
    for section in config.__struct_fields__:
        for key in _non_finite(getattr(config, section), section):
            errors.append(f"{key} must be a finite number (inf and nan are not)")
    sampling = config.sampling
    problem = sampling_error(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )
    # temperature = 0 has its own message (greedy leaves RL nothing to explore); non-finite ones are above.
    finite_temperature = math.isfinite(sampling.temperature) and math.isfinite(sampling.top_p)
    if problem is not None and sampling.temperature != 0 and finite_temperature:
        errors.append(f"sampling.{problem[1]}")
    for index, beta in enumerate(config.trainer.betas):
        if math.isfinite(beta) and not 0 <= beta < 1:
            errors.append(
                f"trainer.betas[{index}] = {beta} must be in [0, 1): Adam's moving averages decay by it "
                "each step (0.9 and 0.999 are usual)"
            )
    return errors


def _agent_errors(config: RunConfig) -> list[str]:
    agent = config.agent
    if agent is None:
        return []
    errors = []
    if (agent.callable is None) == (agent.command is None):
        errors.append("[agent] needs exactly one of agent.callable (an async function) and agent.command")
    if agent.command is not None and not (
        agent.command.strip() if isinstance(agent.command, str) else agent.command
    ):
        errors.append("agent.command is empty")
    if agent.env and agent.command is None:
        errors.append("agent.env is only passed to agent.command; remove it or use agent.command")
    if agent.max_seq_len is None:
        errors.append(
            "agent.max_seq_len must be set: the longest training sample in tokens (e.g. inference.max_model_len)"
        )
    elif agent.max_seq_len < config.sampling.max_tokens:
        errors.append(
            f"agent.max_seq_len ({agent.max_seq_len}) must be >= sampling.max_tokens "
            f"({config.sampling.max_tokens}): one model call alone could not fit"
        )
    if config.data.reward is not None:
        errors.append(
            "data.reward is not used with [agent]: the agent returns each trajectory's reward; remove data.reward"
        )
    if not agent.host or any(c.isspace() or c == "/" for c in agent.host):
        errors.append(
            f"agent.host = {agent.host!r} must be an interface name or address like '127.0.0.1' or "
            "'0.0.0.0' (no scheme, port or path)"
        )
    if agent.advertise_url is not None and not _BASE_URL.fullmatch(agent.advertise_url):
        errors.append(
            f"agent.advertise_url = {agent.advertise_url!r} must be a base URL like 'http://proxy-host:8100' "
            "(http or https, no path)"
        )
    if agent.proxy_workers > 1:
        # Each worker listens on a free port of its own: one port or one advertised URL cannot name them all.
        listener = [f"agent.port = {agent.port}"] if agent.port else []
        if agent.advertise_url is not None:
            listener.append(f"agent.advertise_url = {agent.advertise_url!r}")
        if listener:
            errors.append(
                f"agent.proxy_workers = {agent.proxy_workers} runs that many proxies, each on a free port of "
                f"its own, which {' and '.join(listener)} cannot name; set agent.port = 0 and unset "
                "agent.advertise_url, or set agent.proxy_workers = 1"
            )
    return errors


def _inference_errors(inference: InferenceConfig) -> list[str]:
    errors = []
    external = []
    if inference.external_proxy_url is not None:
        external.append("inference.external_proxy_url")
    if inference.external_server_urls:
        external.append("inference.external_server_urls")
    if inference.mode == "local" and external:
        errors.append(
            f"{' and '.join(external)} need inference.mode = 'http' (got 'local', which runs engines in "
            "this process); set inference.mode = 'http' or remove them"
        )
    if inference.colocate and external:
        errors.append(
            f"inference.colocate = true cannot be combined with {' and '.join(external)}: colocation needs "
            "servers that rollflow starts itself; remove the external URLs or set inference.colocate = false"
        )
    if inference.engine == "vllm" and inference.mode == "local":
        errors.append(
            "inference.engine = 'vllm' runs vLLM servers and needs inference.mode = 'http' "
            "(local mode runs rollflow's torch engines in process)"
        )
    urls = (
        [("inference.external_proxy_url", inference.external_proxy_url)]
        if inference.external_proxy_url
        else []
    )
    urls += [
        (f"inference.external_server_urls[{i}]", url) for i, url in enumerate(inference.external_server_urls)
    ]
    for field, url in urls:
        if not _BASE_URL.fullmatch(url):
            errors.append(
                f"{field} = {url!r} must be a base URL like 'http://host:8000' (http or https, no path)"
            )
    if inference.api_key is not None and (
        not inference.api_key or any(c.isspace() for c in inference.api_key)
    ):
        errors.append(
            "inference.api_key must be a non-empty token without spaces or line breaks (it is sent as "
            "'Authorization: Bearer <api_key>'); remove it for no key"
        )
    if len(set(inference.external_server_urls)) != len(inference.external_server_urls):
        errors.append("inference.external_server_urls lists a server more than once")
    return errors


# Server flags rollflow sets itself, and the key that sets each ("": none, rollflow picks it); not allowed in
# ``inference.server_args``.
MANAGED_SERVER_FLAGS = {
    "--host": "",
    "--port": "",
    "--model": "model.path",
    "--served-model-name": "model.path",
    "--tensor-parallel-size": "inference.tensor_parallel_size",
    "-tp": "inference.tensor_parallel_size",
    "--data-parallel-size": "inference.num_servers",
    "--gpu-memory-utilization": "inference.gpu_memory_utilization",
    "--dtype": "inference.dtype",
    "--max-model-len": "inference.max_model_len",
    "--max-num-seqs": "inference.max_batch_size",
    "--max-batch-size": "inference.max_batch_size",
    "--api-key": "inference.api_key",
    "--enable-sleep-mode": "inference.colocate",
    "--weight-transfer-config": "weight_sync.strategy",
    "--device": "inference.device",
    "--enable-return-routed-experts": "inference.return_routed_experts",
}


def _server_option_errors(inference: InferenceConfig) -> list[str]:
    """The options of the servers rollflow starts: what the chosen engine can take, and only for servers it
    starts."""
    errors = []
    external = inference.external_proxy_url is not None or bool(inference.external_server_urls)
    if external and inference.mode == "http":
        for key, is_set in (
            ("inference.tensor_parallel_size", inference.tensor_parallel_size != 1),
            ("inference.gpu_memory_utilization", inference.gpu_memory_utilization is not None),
            ("inference.server_args", bool(inference.server_args)),
        ):
            if is_set:
                errors.append(
                    f"{key} applies to the servers rollflow starts, not to external ones "
                    "(inference.external_proxy_url, inference.external_server_urls); remove it"
                )
    if inference.engine == "torch":
        if inference.tensor_parallel_size != 1:
            errors.append(
                f"inference.tensor_parallel_size = {inference.tensor_parallel_size} needs vLLM servers "
                "(inference.engine = 'vllm'): rollflow's torch engine runs each server on one device; set it to "
                "1, or use more servers (inference.num_servers)"
            )
        if inference.gpu_memory_utilization is not None:
            errors.append(
                "inference.gpu_memory_utilization applies to vLLM servers (inference.engine = 'vllm'); the torch "
                "engine sizes its KV cache from inference.max_batch_size and inference.max_model_len: remove it"
            )
        if inference.dtype not in ("auto", "float32"):
            errors.append(
                f"inference.dtype = {inference.dtype!r} needs vLLM servers (inference.engine = 'vllm'): rollflow's "
                "torch engine computes in float32; set inference.dtype = 'auto' or 'float32'"
            )
    for index, arg in enumerate(inference.server_args):
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_SERVER_FLAGS:
            key = MANAGED_SERVER_FLAGS[flag]
            fix = f"set {key} instead" if key else "rollflow picks each server's address and port; remove it"
            errors.append(f"inference.server_args[{index}] = {arg!r} sets a flag rollflow sets itself: {fix}")
        elif not arg:
            errors.append(f"inference.server_args[{index}] is empty; remove it")
    return errors


def _colocation_errors(config: RunConfig) -> list[str]:
    inference = config.inference
    if not inference.colocate:
        return []
    errors = []
    if inference.mode == "local":
        errors.append(
            "inference.colocate = true needs inference.mode = 'http' (servers that sleep while the trainer "
            "steps); in-process engines (mode 'local') already share the trainer's device: remove "
            "inference.colocate or set inference.mode = 'http'"
        )
    if config.orchestrator.mode == "fully_async":
        errors.append(
            "inference.colocate = true cannot run with orchestrator.mode = 'fully_async': colocated servers "
            "sleep while the trainer steps, so generation cannot go on during training; use "
            "orchestrator.mode = 'sync' or 'one_step', or set inference.colocate = false"
        )
    return errors


def _cluster_errors(config: RunConfig) -> list[str]:
    cluster = config.cluster
    errors = []
    address = cluster.address
    if address not in ("local", "auto") and not _RAY_ADDRESS.fullmatch(address):
        errors.append(
            f"cluster.address = {address!r} must be 'local' (a private Ray instance), 'auto' (the cluster this "
            "machine joined with `ray start`) or a head address like 'HOST:6379' or 'ray://HOST:10001'"
        )
    for name in cluster.env:
        if not _ENV_NAME.fullmatch(name):
            errors.append(f"cluster.env has {name!r}, which is not an environment variable name")
    if cluster.backend == "local":
        changed = [
            f"cluster.{key}"
            for key in ("address", "env", "num_cpus")
            if getattr(cluster, key) != getattr(_CLUSTER_DEFAULTS, key)
        ]
        if changed:
            errors.append(
                f"{' and '.join(changed)} only apply to cluster.backend = 'ray' (got 'local', which runs "
                "every process on this machine); set cluster.backend = 'ray' or remove them"
            )
    else:
        if cluster.num_cpus is not None and address != "local":
            errors.append(
                f"cluster.num_cpus sizes the private Ray instance of cluster.address = 'local', not the "
                f"cluster at {address!r}; remove it"
            )
        if config.trainer.placement == "process":
            errors.append(
                "trainer.placement = 'process' places a local trainer; with cluster.backend = 'ray' the "
                "trainer's ranks always run as Ray actors (trainer.num_workers of them): remove "
                "trainer.placement or set cluster.backend = 'local'"
            )
    return errors


def resolve_api_key(inference: InferenceConfig) -> str | None:
    """``inference.api_key``, else ``$ROLLFLOW_API_KEY``, else None (read at use, so a key from the
    environment never lands in the saved config)."""
    return inference.api_key or os.environ.get("ROLLFLOW_API_KEY") or None


def _apply_env_overrides(data: dict[str, Any]) -> dict[str, Any]:
    """``ROLLFLOW_INFERENCE_MODE`` overrides ``inference.mode`` (so one test suite runs in either mode)."""
    mode = os.environ.get(INFERENCE_MODE_ENV)
    if not mode:
        return data
    if mode not in ("local", "http"):
        raise ConfigError(f"environment variable {INFERENCE_MODE_ENV}={mode!r} must be 'local' or 'http'")
    inference = data.get("inference")
    inference = dict(inference) if isinstance(inference, Mapping) else {}
    configured = inference.get("mode")
    if configured is not None and configured != mode:
        log.warning(
            f"{INFERENCE_MODE_ENV}={mode} overrides inference.mode = {configured!r} of the config; unset "
            f"{INFERENCE_MODE_ENV} to use the config's",
            env=mode,
            config=configured,
        )
    return {**data, "inference": {**inference, "mode": mode}}


INFERENCE_MODE_ENV = "ROLLFLOW_INFERENCE_MODE"
_BASE_URL = re.compile(r"https?://[A-Za-z0-9._\-\[\]:]+(:[0-9]{1,5})?/?")
_RAY_ADDRESS = re.compile(r"(ray://)?[A-Za-z0-9._\-\[\]:]+:[0-9]{1,5}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLUSTER_DEFAULTS = ClusterConfig()
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?")
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _key_path(path: str) -> str:
    """``.trainer.betas[0]`` → ``trainer.betas[0]``."""
    return path.lstrip(".")


def _translate(error: msgspec.ValidationError, source: str) -> ConfigError:
    message = str(error)
    if match := _UNKNOWN_FIELD.match(message):
        parent = _key_path(match["path"] or "")
        key = f"{parent}.{match['field']}" if parent else match["field"]
        return ConfigError(f"{source}: unknown config key '{key}' (check its spelling and section)")
    if match := _AT_PATH.search(message):
        key = _key_path(match["path"])
        reason = message[: match.start()]
        return ConfigError(f"{source}: invalid value for '{key}': {reason}")
    return ConfigError(f"{source}: {message}")


def deep_merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``overlay`` into a copy of ``base``; tables merge key by key, everything else is replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(override: str) -> dict[str, Any]:
    """``trainer.lr=3e-4`` → ``{"trainer": {"lr": 3e-4}}``. Values are TOML (``true``, ``[1, 2]``,
    ``"text"``); anything that is not valid TOML is taken as a string."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=3e-4")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    nested: dict[str, Any] = {}
    cursor = nested
    *parents, leaf = key.split(".")
    for part in parents:
        cursor = cursor.setdefault(part, {})
    cursor[leaf] = value
    return nested


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read one TOML file; a missing file or a syntax error is a ConfigError naming the file."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None


def read_toml_or_json(path: str | Path) -> dict[str, Any]:
    """Read a config file by its suffix: ``.json`` (a saved resolved config) or TOML."""
    path = Path(path)
    if path.suffix != ".json":
        return read_toml(path)
    try:
        data = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except msgspec.DecodeError as error:
        raise ConfigError(f"{path}: invalid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def build_config(data: Mapping[str, Any], source: str = "config") -> RunConfig:
    """Validate a merged config dict into a RunConfig; ``ROLLFLOW_INFERENCE_MODE``, when set, overrides
    ``inference.mode``.

    Raises:
        ConfigError: an unknown key, a wrong type or value, a broken cross-field rule, or a bad
            ``ROLLFLOW_INFERENCE_MODE``.
    """
    data = _apply_env_overrides(dict(data))
    try:
        config = msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as error:
        raise _translate(error, source) from None
    if errors := _cross_field_errors(config):
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return config


#: Config keys whose values name a file or directory. ``load_config`` resolves them relative to the file
#: that sets them.
FILE_PATH_KEYS: tuple[tuple[str, ...], ...] = (("data", "path"), ("eval", "path"))
#: Config keys whose values may be code specs ``path/to/file.py:attribute`` (``[]``: each entry of a list);
#: ``load_config`` resolves the file part likewise. Built-in names and module paths are left alone.
CODE_SPEC_KEYS: tuple[tuple[str, ...], ...] = (
    ("data", "task"),
    ("data", "reward"),
    ("data", "rewards", "[]", "fn"),
    ("agent", "callable"),
    ("agent", "composer"),
)


def resolve_file_paths(data: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``data`` (one config file's contents) with each relative path of ``FILE_PATH_KEYS``, and the file part
    of each code spec ``file.py:attribute`` of ``CODE_SPEC_KEYS``, made absolute where it exists under
    ``base_dir``. Anything else (built-in names, module paths, names of cached datasets, paths that do not
    exist there) is kept as written."""

    def resolve(value: Any, keys: tuple[str, ...], spec: bool) -> Any:
        if keys:
            key, rest = keys[0], keys[1:]
            if key == "[]":
                return [resolve(item, rest, spec) for item in value] if isinstance(value, list) else value
            if isinstance(value, Mapping) and key in value:
                return {**value, key: resolve(value[key], rest, spec)}
            return value
        if not isinstance(value, str):
            return value
        if not spec:
            return _under(value, base_dir)
        module, sep, attribute = value.rpartition(":")
        return f"{_under(module, base_dir)}:{attribute}" if sep and module.endswith(".py") else value

    resolved = dict(data)
    for keys in FILE_PATH_KEYS:
        resolved = resolve(resolved, keys, spec=False)
    for keys in CODE_SPEC_KEYS:
        resolved = resolve(resolved, keys, spec=True)
    return resolved


def _under(text: str, base_dir: Path) -> str:
    """``base_dir / text`` as an absolute path when ``text`` is relative and exists there, else ``text``."""
    path = Path(text).expanduser()
    if path.is_absolute() or not text:
        return text
    candidate = base_dir / path
    return os.path.abspath(candidate) if candidate.exists() else text


def load_config(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = (),
    overrides: str | Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load and validate the run config from TOML files (one path, or several merged left to right) and
    ``KEY=VALUE`` overrides.

    ``base`` (e.g. a resumed run's saved config) sits below the files. Relative file paths a file names
    (``FILE_PATH_KEYS``) are taken relative to that file's directory where they exist there, so a config
    works from any working directory; otherwise they stay relative to the working directory.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a bad value or a broken cross-field rule.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if isinstance(overrides, str):
        overrides = [overrides]
    merged: dict[str, Any] = dict(base or {})
    for path in paths:
        data = read_toml_or_json(path)
        merged = deep_merge(merged, resolve_file_paths(data, Path(path).parent))
    overrides = list(overrides)
    for override in overrides:
        merged = deep_merge(merged, parse_override(override))
    sources = [str(path) for path in paths] + [f"--set {o}" for o in overrides]
    return build_config(merged, source=", ".join(sources) or "defaults")


def to_dict(config: RunConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able data (every field, defaults included)."""
    return msgspec.to_builtins(config)


def to_json(config: RunConfig) -> bytes:
    return msgspec.json.format(msgspec.json.encode(config), indent=2)
