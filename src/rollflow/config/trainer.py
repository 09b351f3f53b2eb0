"""``[trainer]``: the optimizer, the loss and where training steps run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

from rollflow.config.base import NonNegative, NonNegativeFloat, Positive, PositiveFloat, Section

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class LoraConfig(Section):
    """``[trainer.lora]``: train a low-rank adapter (``peft``'s LoRA) instead of every weight."""

    rank: Positive = 8
    """The adapter's rank r: each targeted ``Linear`` of shape ``[out, in]`` gets ``A [r, in]`` and
    ``B [out, r]``; at most the smaller of the two sizes of every targeted layer."""
    alpha: PositiveFloat = 16.0
    """LoRA's alpha: the update ``B @ A`` is scaled by ``alpha / rank``."""
    dropout: NonNegativeFloat = 0.0
    """Dropout on the adapter's input during training (in [0, 1)); 0 keeps the trainer's forward
    deterministic, as the engines' is."""
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Which ``torch.nn.Linear`` modules get an adapter. Each entry matches a module whose full name ends with
    it at a dot (``q_proj``, ``self_attn.o_proj``) or, failing that, that it matches as a whole as a regular
    expression (``model\\.layers\\.[01]\\..*_proj``). Every entry must match at least one ``Linear``. The
    output head is adapted only by an entry ``lm_head`` (then the logits are computed whole, not in
    ``logprob_chunk_tokens`` chunks); its adapter changes the logits directly, and a tied head is untied
    where the adapter is merged (engine, ``--merge``). A model whose head was never trained (the random-init
    ``rollflow:tiny``) needs ``lm_head`` here: adapters on the projections alone cannot move its near-uniform
    output (``examples/quickstart_lora.toml``). With ``inference.engine = "vllm"`` ``lm_head`` is refused
    (vLLM 0.32 then serves the base model's requests wrongly; ``rollflow.weights.vllm_lora``)."""
    init: Literal["default", "gaussian"] = "default"
    """How A starts (B starts at 0 either way, so the adapted model starts as the base): ``default``:
    Kaiming-uniform (``peft``'s default), ``gaussian``: normal with std ``1 / rank``."""


class OffPolicyTable(Section):
    """``[trainer.off_policy]``: one behaviour correction, from the trainer's start-of-step policy back to
    the sampler's (``rollflow.train.off_policy`` has the formulas and their references).

    With ``rho_t = pi_trainer(t) / pi_behaviour(t)`` of each sampled token:

    - ``kind = "none"``: no correction; the PPO ratio is taken against the behaviour logprobs.
    - ``kind = "tis"``: truncated IS, weight ``min(rho, high)``; ``level`` ``token`` (rho_t) or
      ``sequence`` (the product of a sequence's rho_t, shared by its tokens). ``high`` defaults to 2.
    - ``kind = "mis"``: masked IS, weight ``rho`` inside ``[low, high]`` and 0 outside; ``level`` ``token``,
      ``sequence`` (the product) or ``geometric`` (a sequence is kept, with weight 1, when the geometric mean
      of its rho_t is inside the bounds). ``high`` defaults to 2 (required for ``geometric``, whose ratios sit
      within a fraction of a percent of 1), ``low`` to ``1 / high``.
    - ``kind = "icepop"``: IcePop's two-sided token mask, ``mis`` at ``token`` level with its own defaults
      ``low = 0.5``, ``high = 5``.
    - ``kind = "decoupled"``: AReaL's decoupled PPO, weight ``rho_t`` uncapped, or 0 above ``high``.

    Every kind but ``none`` takes the PPO ratio against the trainer's own weights at the start of the step
    (decoupled PPO's proximal policy), so each is decoupled PPO with its own shaping of the weight.
    """

    kind: Literal["none", "tis", "mis", "icepop", "decoupled"]
    """Which correction (see the table's docstring)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """Over what the ratio is taken and the rule applied: each token, each sequence's product of token
    ratios, or each sequence's geometric mean (``mis`` only)."""
    low: NonNegativeFloat | None = None
    """Lower bound of the kept ratios (``mis``, ``icepop``); below 1."""
    high: PositiveFloat | None = None
    """Truncation (``tis``), upper bound of the kept ratios (``mis``, ``icepop``) or filter cap
    (``decoupled``); above 1."""

    def with_defaults(self) -> OffPolicyTable:
        """This table with the kind's default bounds filled in (``low``/``high`` left unset where the kind
        has none)."""
        high, low = self.high, self.low
        if self.kind == "tis" and high is None:
            high = 2.0
        if self.kind == "mis":
            if high is None and self.level != "geometric":
                high = 2.0
            if low is None and high is not None:
                low = 1.0 / high
        if self.kind == "icepop":
            low = 0.5 if low is None else low
            high = 5.0 if high is None else high
        return OffPolicyTable(kind=self.kind, level=self.level, low=low, high=high)


class TrainerConfig(Section):
    lr: PositiveFloat = 1e-3
    """Peak AdamW learning rate (finite, > 0); see ``lr_schedule``. Like every number in the config, inf and nan
    are refused."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate over the run's ``orchestrator.steps`` training steps, after ``warmup_steps`` of linear
    warm-up from 0 (the factors of transformers' ``get_scheduler``): ``constant`` stays at ``lr``, ``linear`` decays to 0,
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
    share_prompts: bool = True
    """Samples of a micro-batch with the same prompt (a group's) run that prompt through the forward once:
    one packed row per prompt, the completions after it under a block attention mask
    (``rollflow.train.shared_prompts``); the logprobs are the same up to float rounding. Used where it
    removes at least a fifth of the micro-batch's token positions, with models whose attention is SDPA without
    sliding windows (others, and MoE routing replay, run the rows as they are). False always runs the rows."""
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
    """Torch threads of a training step; unset keeps torch's count (the cores, or ``OMP_NUM_THREADS``),
    which trainer workers share. When generation shares the cores (async modes on one machine), fewer
    threads than cores lets the two overlap instead of contending."""
    placement: Literal["thread", "process"] = "thread"
    """Where training steps run. ``thread``: a worker thread of the orchestrator's process. ``process``: a
    child process of its own (``rollflow.train.process``), so a step never waits for the interpreter lock
    the event loop holds while it handles generation; worth it in the overlapped modes when the step's
    Python overhead matters (small models, CPU). It adds the child's start-up (importing torch and loading
    the model) to the run's; its weights are shared with the orchestrator through shared memory. The child
    is spawned, so a script that starts a run must guard its entry point (``if __name__ == "__main__":``)."""
    off_policy: Literal["auto", "none", "tis", "decoupled"] | OffPolicyTable = "auto"
    """Correction for tokens the trainer's policy would not have sampled: older policy versions (the async
    modes) and sampler/trainer numerical mismatch (``rollflow.train.off_policy``). A name, or a table
    (``[trainer.off_policy]``: ``kind``, ``level``, ``low``, ``high``; see ``OffPolicyTable``) for the whole
    menu. ``none``: PPO-clip directly against the behaviour (sampler) logprobs. ``tis``: PPO-clip against the
    trainer's own weights at the start of the step, each token weighted by ``min(pi_trainer / pi_behaviour,
    tis_cap)``. ``decoupled``: the same objective with the weight uncapped, or with tokens above
    ``decoupled_cap`` left out (AReaL's decoupled PPO). ``auto``: ``none`` in ``sync`` mode, ``tis`` in the
    async modes."""
    tis_cap: PositiveFloat = 2.0
    """``off_policy = "tis"`` (the name): the truncation C of the importance weight (>= 1, so on-policy
    tokens keep weight 1). With the table, ``trainer.off_policy.high``."""
    decoupled_cap: PositiveFloat | None = None
    """``off_policy = "decoupled"`` (the name): tokens whose importance weight exceeds it are left out of the
    loss (> 1); unset keeps every token at its full weight. With the table, ``trainer.off_policy.high``."""
    ratio_level: Literal["token", "sequence"] = "token"
    """What the PPO ratio ``pi_theta / pi_anchor`` (anchor: behaviour or start-of-step logprobs, per
    ``off_policy``) is taken over. ``token``: per token, clipped per token (PPO, GRPO). ``sequence``: GSPO
    (Zheng et al. 2025): each sequence's length-normalised ratio ``exp(mean_t log(pi_theta / pi_anchor))``,
    clipped per sequence; every token of a sequence then shares its value and clip decision. GSPO's own
    objective is a mean over sequences: pair it with ``loss_agg = "seq_mean_token_mean"``; its clip ranges
    are far smaller than PPO's (the paper: ``clip_low = 3e-4``, ``clip_high = 4e-4``)."""
    loss: Literal["ppo_clip", "cispo"] = "ppo_clip"
    """The policy-gradient objective. ``ppo_clip``: PPO's clipped surrogate (a clipped token has no
    gradient). ``cispo``: MiniMax-M1's CISPO (2025): ``-sg[clip(r, 1 - clip_low, 1 + clip_high)] * A *
    log pi_theta`` per token, so the ratio's weight is bounded but every token keeps its gradient. Token
    ratios only (``ratio_level = "token"``). MiniMax sets no lower bound (a large ``clip_low``) and tunes
    ``clip_high``."""
    mismatch_kl_threshold: NonNegativeFloat = 0.01
    """A warning is logged when the rollout-vs-trainer KL on the sampled tokens (``off_policy/kl_k3``) is
    above this for ``mismatch_kl_steps`` consecutive steps (once per such streak); 0 disables it."""
    mismatch_kl_steps: Positive = 5
    """Consecutive steps above ``mismatch_kl_threshold`` before the warning."""
    lora: LoraConfig | None = None
    """``[trainer.lora]``: train a LoRA adapter on the frozen base model (``rollflow.train.lora``); unset
    trains every weight. The base stays frozen (no gradients, no optimizer state), the adapter is float32 with
    AdamW state of its own; weight updates send the adapter only (the torch engine merges it into its copy of
    the base), checkpoints hold the adapter and its optimizer state, and the KL reference is the base with the
    adapter switched off (no second copy of the model)."""

    def resolved_off_policy(
        self, orchestrator_mode: str
    ) -> Literal["none", "tis", "mis", "icepop", "decoupled"]:
        """The kind of ``off_policy`` with ``auto`` resolved for ``orchestrator.mode``
        (``rollflow.config.resolve``)."""
        if isinstance(self.off_policy, OffPolicyTable):
            return self.off_policy.kind
        from rollflow.config.resolve import off_policy_for

        return off_policy_for(self.off_policy, orchestrator_mode)

    def off_policy_correction(self, orchestrator_mode: str) -> OffPolicyTable:
        """``off_policy`` as a table with every default filled in, for ``orchestrator.mode``: what
        ``Trainer`` takes. The names map onto the table: ``tis`` is ``kind = "tis"`` with ``high =
        tis_cap``, ``decoupled`` is ``kind = "decoupled"`` with ``high = decoupled_cap``."""
        if isinstance(self.off_policy, OffPolicyTable):
            return self.off_policy.with_defaults()
        return correction_for_name(self.resolved_off_policy(orchestrator_mode), self)


def correction_for_name(name: str, trainer: TrainerConfig) -> OffPolicyTable:
    """The table a named ``trainer.off_policy`` (``none``, ``tis``, ``decoupled``) stands for.

    Raises:
        ValueError: another name (``auto`` must be resolved first).
    """
    if name == "none":
        return OffPolicyTable(kind="none")
    if name == "tis":
        return OffPolicyTable(kind="tis", high=trainer.tis_cap)
    if name == "decoupled":
        return OffPolicyTable(kind="decoupled", high=trainer.decoupled_cap)
    raise ValueError(
        f"off_policy = {name!r}: pass 'none', 'tis' or 'decoupled', or an OffPolicyTable "
        "(resolve 'auto' with TrainerConfig.off_policy_correction)"
    )


def trainer_errors(config: RunConfig) -> list[str]:
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
    errors += lora_errors(config)
    if trainer.kl_in == "reward" and trainer.kl_coef == 0:
        errors.append(
            "trainer.kl_in = 'reward' with trainer.kl_coef = 0 puts no penalty in the reward; set "
            "trainer.kl_coef > 0 (e.g. 0.001) or leave trainer.kl_in = 'loss'"
        )
    return errors


def off_policy_errors(config: RunConfig) -> list[str]:
    trainer = config.trainer
    off_policy = trainer.resolved_off_policy(config.orchestrator.mode)
    errors = []
    if trainer.loss == "cispo" and trainer.ratio_level == "sequence":
        errors.append(
            "trainer.loss = 'cispo' clips each token's own importance weight; it has no sequence-level form: "
            "set trainer.ratio_level = 'token', or trainer.loss = 'ppo_clip' for GSPO's sequence ratio"
        )
    if isinstance(trainer.off_policy, OffPolicyTable):
        return errors + _table_errors(trainer)
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


#: ``weight_sync.strategy`` values that can send an adapter alone (``cuda_ipc`` shares the engines' full
#: parameter storage, which an adapter does not have).
LORA_STRATEGIES = ("local", "broadcast", "checkpoint")


def lora_errors(config: RunConfig) -> list[str]:
    """What ``[trainer.lora]`` cannot run with, read from the config alone (the model's modules are checked
    against ``target_modules`` and ``rank`` by ``rollflow.train.lora.check_lora_targets`` before any process
    starts)."""
    lora = config.trainer.lora
    if lora is None:
        return []
    errors = []
    if not lora.dropout < 1:
        errors.append(f"trainer.lora.dropout = {lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        errors.append(
            "trainer.lora.target_modules is empty: name the Linear modules to adapt (e.g. 'q_proj')"
        )
    strategy = config.weight_sync.resolved_strategy(config.inference.mode)
    if config.inference.engine == "vllm":
        errors += _vllm_lora_errors(config)
    elif strategy not in LORA_STRATEGIES:
        errors.append(
            f"trainer.lora with weight_sync.strategy = {config.weight_sync.strategy!r}: an adapter travels by "
            f"{', '.join(LORA_STRATEGIES)} only; pick one of those (or 'auto') or unset trainer.lora"
        )
    if strategy == "local" and config.trainer.placement == "process" and config.trainer.num_workers == 1:
        errors.append(
            "trainer.lora with trainer.placement = 'process' and in-process engines (weight_sync.strategy = "
            "'local'): those engines read the trainer process's weights through shared memory, which holds "
            "no scaled adapter; use trainer.placement = 'thread' or inference.mode = 'http'"
        )
    return errors


# The largest --max-lora-rank vLLM accepts.
VLLM_MAX_LORA_RANK = 512


def _vllm_lora_errors(config: RunConfig) -> list[str]:
    """What vLLM's LoRA serving cannot take (``rollflow.weights.vllm_lora``: one adapter per version, loaded
    from a PEFT directory)."""
    lora = config.trainer.lora
    assert lora is not None
    errors = []
    if "lm_head" in lora.target_modules:
        errors.append(
            "trainer.lora.target_modules names 'lm_head' with inference.engine = 'vllm': vLLM (0.32.0, "
            "measured) serves an lm_head adapter's requests right, but from then on serves the base model's "
            "requests with wrong logprobs (tied embeddings); adapt the projections only, or use inference"
            ".engine = 'torch' (a random-init model such as rollflow:tiny then needs lm_head to learn)"
        )
    if lora.rank > VLLM_MAX_LORA_RANK:
        errors.append(
            f"trainer.lora.rank = {lora.rank} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANK})"
        )
    if config.weight_sync.strategy not in ("auto", "checkpoint"):
        errors.append(
            f"trainer.lora with inference.engine = 'vllm' and weight_sync.strategy = "
            f"{config.weight_sync.strategy!r}: vLLM loads an adapter from a PEFT directory "
            "(/v1/load_lora_adapter), not by weight transfer; set weight_sync.strategy = 'auto' or "
            "'checkpoint' (weight_sync.checkpoint_dir: a directory every server reads)"
        )
    if config.weight_sync.backend is not None:
        errors.append(
            f"weight_sync.backend = {config.weight_sync.backend!r} with trainer.lora on vLLM: the adapter "
            "travels as files, not by broadcast; leave weight_sync.backend unset"
        )
    return errors


def _table_errors(trainer: TrainerConfig) -> list[str]:
    """What ``[trainer.off_policy]`` cannot mean: combinations no reference defines, bounds that would cut
    on-policy tokens (whose ratio is 1), and the name form's keys next to the table."""
    table = trainer.off_policy
    assert isinstance(table, OffPolicyTable)
    key, kind, level = "trainer.off_policy", table.kind, table.level
    errors = []
    if trainer.tis_cap != 2.0 or trainer.decoupled_cap is not None:
        errors.append(
            "trainer.tis_cap and trainer.decoupled_cap belong to the named trainer.off_policy; with the "
            f"[trainer.off_policy] table set {key}.high instead"
        )
    if kind == "none":
        if level != "token" or table.low is not None or table.high is not None:
            errors.append(
                f"{key}.kind = 'none' corrects nothing: {key}.level, .low and .high do not apply; remove them "
                "or pick a kind ('tis', 'mis', 'icepop', 'decoupled')"
            )
        return errors
    if kind in ("icepop", "decoupled") and level != "token":
        errors.append(
            f"{key}.level = {level!r} with {key}.kind = {kind!r}: {kind} is defined on token ratios only; set "
            f"{key}.level = 'token', or use kind = 'mis' (masked IS) for sequence or geometric masks"
        )
    if kind == "tis" and level == "geometric":
        errors.append(
            f"{key}.level = 'geometric' with {key}.kind = 'tis': a geometric mean is no importance weight to "
            f"truncate; use kind = 'mis' for a geometric mask, or level = 'token' / 'sequence' for TIS"
        )
    if kind in ("tis", "decoupled") and table.low is not None:
        errors.append(
            f"{key}.low = {table.low} with {key}.kind = {kind!r}: {kind} only bounds the weight from above "
            f"({key}.high); use kind = 'mis' or 'icepop' for a two-sided mask"
        )
    if kind == "mis" and level == "geometric" and table.high is None:
        errors.append(
            f"{key}.kind = 'mis' with level = 'geometric' needs {key}.high: geometric means of token ratios sit "
            "within a fraction of a percent of 1 (typical: 1.0002 to 1.001; low defaults to 1 / high)"
        )
    resolved = table.with_defaults()
    if resolved.high is not None and resolved.high <= 1:
        errors.append(
            f"{key}.high = {resolved.high} must be above 1: on-policy tokens have ratio 1 and would be "
            "truncated or masked too"
        )
    if resolved.low is not None and resolved.low >= 1:
        errors.append(
            f"{key}.low = {resolved.low} must be below 1: on-policy tokens have ratio 1 and would be masked too"
        )
    return errors
