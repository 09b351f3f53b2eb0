"""MoE routing replay on ``rollflow:tiny-moe``: samples carry the experts the torch engine routed each token to,
and the trainer's forward uses them.

The engine and the trainer share weights except where a test perturbs the trainer's routers, which stands in
for whatever makes a trainer route differently from the sampler (other kernels, bf16, a stale policy).
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config import TrainerConfig
from rollflow.inference.engine import TorchEngine
from rollflow.messages import GenerateRequest, SamplingParams, ScoredGroup, TrainBatch
from rollflow.tito.composer import TITOSample
from rollflow.train import routing_replay
from rollflow.train.losses import model_token_logprobs
from rollflow.train.trainer import Trainer

from .helpers.training import PackingTrainer


@pytest.fixture(scope="module")
def moe_model(tiny_moe_model_dir):
    """tiny-moe with its experts re-drawn at std 0.3 (seeded): at the init's 0.02 an expert adds so little to
    the residual stream that which experts a token takes hardly shows in its logprobs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.3, generator=generator)
    return model


@pytest.fixture(scope="module")
def sampled(moe_model):
    """Eight prompts x two completions from the engine, with logprobs and routed experts: enough tokens (about
    250) that a router drift re-routes a few dozen of them (the replay test compares means over those)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 9, 14, 20, 7, 11, 16, 24)
    ]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)

    async def generate():
        engine = TorchEngine(
            copy.deepcopy(moe_model), max_batch_size=8, max_model_len=128, return_routed_experts=True
        )
        try:
            requests = [
                GenerateRequest(prompt_token_ids=p, sampling=params) for p in prompts for _ in range(2)
            ]
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.shutdown()

    outputs = asyncio.run(generate())
    groups = []
    for index, prompt in enumerate(prompts):
        samples = []
        for sample_index, output in enumerate(outputs[2 * index : 2 * index + 2]):
            assert output.routed_experts.shape[0] == len(prompt) + len(output.token_ids) - 1
            samples.append(
                TITOSample(
                    prompt_index=index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt,
                    completion_token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    policy_versions=[0] * len(output.token_ids),
                    finish_reason=output.finish_reason,
                    reward=float(sample_index),
                    routed_experts=output.routed_experts,
                )
            )
        groups.append(samples)
    return groups


def batch_of(groups, routes: str = "recorded") -> TrainBatch:
    """``routes``: ``recorded`` (as sampled), ``none`` (stripped) or ``shifted`` (every id moved to the next
    expert: routes the sampler never took)."""
    scored = []
    for index, samples in enumerate(groups):
        changed = []
        for sample in samples:
            record = sample.routed_experts
            if routes == "none":
                record = None
            elif routes == "shifted":
                record = (record + 1) % 4
            changed.append(
                TITOSample(
                    **{f: getattr(sample, f) for f in sample.__struct_fields__ if f != "routed_experts"}
                )
            )
            changed[-1].routed_experts = record
        scored.append(ScoredGroup(prompt_index=index, samples=changed))
    return TrainBatch(step=0, groups=scored)


def trainer_for(model, **config) -> Trainer:
    return PackingTrainer(
        copy.deepcopy(model), TrainerConfig(lr=1e-3, **config), pad_token_id=model.config.pad_token_id
    )


def perturbed_routers(model, std: float):
    """A copy whose routers are moved by noise of ``std``, enough to flip some top-2 choices."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for router in routing_replay.moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * std)
    return model


def routes_of(model, sample) -> np.ndarray:
    """The top-2 experts ``model`` itself picks for a sample's tokens (a plain HF forward)."""
    tokens = sample.prompt_token_ids + sample.completion_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    return np.stack([torch.topk(layer, 2, dim=-1).indices.numpy() for layer in logits], axis=1)


def test_replaying_the_samplers_own_routes_matches_the_engine(moe_model, sampled):
    replayed = trainer_for(moe_model).train_step(batch_of(sampled), policy_version=0)
    plain = trainer_for(moe_model).train_step(batch_of(sampled, "none"), policy_version=0)
    assert replayed.metrics["logprob_mismatch"] < 1e-5
    assert replayed.metrics["loss"] == pytest.approx(plain.metrics["loss"], abs=1e-6)
    assert replayed.metrics["grad_norm"] == pytest.approx(plain.metrics["grad_norm"], rel=1e-5)


def test_the_forward_takes_the_recorded_experts(moe_model, sampled):
    """Routes the sampler never took give logprobs far from its own: the replay is what the forward used."""
    shifted = trainer_for(moe_model).train_step(batch_of(sampled, "shifted"), policy_version=0)
    assert shifted.metrics["logprob_mismatch"] > 1e-2


def test_replay_trains_the_sampled_policy_when_the_trainer_would_route_otherwise(moe_model, sampled):
    """Routers drifted from the sampler's pick other experts for some tokens. Each completion token is judged
    by its mismatch to the engine's logprob, split by whether the drifted router changed the experts at the
    position that predicts it: replay must close the gap there, and change nothing elsewhere."""
    drifted = perturbed_routers(moe_model, std=0.03)
    routing_replay.install(drifted)
    mismatch = {(flipped, replay): [] for flipped in (False, True) for replay in (False, True)}
    for sample in (s for samples in sampled for s in samples):
        tokens = sample.prompt_token_ids + sample.completion_token_ids
        input_ids = torch.tensor([tokens])
        routing_replay.set_routes(drifted, None)
        own, recorded = routes_of(drifted, sample), sample.routed_experts
        logprobs = {}
        for replay in (False, True):
            routing_replay.set_routes(
                drifted, routing_replay.collate_routes([sample], len(tokens)) if replay else None
            )
            with torch.no_grad():
                logprobs[replay] = model_token_logprobs(
                    drifted, input_ids, torch.ones_like(input_ids)
                ).logprobs[0]
        for index, engine_logprob in enumerate(sample.logprobs):
            position = len(sample.prompt_token_ids) + index - 1  # the position whose logits predict the token
            flipped = bool((np.sort(own[position], -1) != np.sort(recorded[position], -1)).any())
            for replay in (False, True):
                mismatch[flipped, replay].append(abs(logprobs[replay][position].item() - engine_logprob))
    routing_replay.set_routes(drifted, None)
    means = {key: float(np.mean(values)) for key, values in mismatch.items()}
    print(
        f"{len(mismatch[True, False])} tokens predicted from re-routed positions: mismatch without replay "
        f"{means[True, False]:.2e}, with {means[True, True]:.2e}; other tokens {means[False, False]:.2e} / "
        f"{means[False, True]:.2e}"
    )
    assert len(mismatch[True, False]) >= 10  # the drift does re-route some tokens
    # Replay brings the re-routed tokens closer to the engine than the other experts put them. Not to zero: the
    # drifted routers still weigh the recorded experts a little differently (the mismatch of the tokens nobody
    # re-routed). Over sampling seeds 11-18 the ratio was 1.4-6x; the forward taking the recorded experts at
    # all is test_the_forward_takes_the_recorded_experts.
    assert means[True, True] < means[True, False] / 1.25
    assert means[False, True] == pytest.approx(means[False, False], rel=0.2)


def test_routers_get_gradients_and_checkpointing_replays_the_same_routes(moe_model, sampled):
    grads = {}
    for checkpointing in (False, True):
        trainer = trainer_for(perturbed_routers(moe_model, std=0.3), gradient_checkpointing=checkpointing)
        trainer.train_step(batch_of(sampled), policy_version=0)
        grads[checkpointing] = [r.weight.grad.clone() for r in routing_replay.moe_routers(trainer.model)]
    assert all(grad.abs().sum() > 0 for grad in grads[False])
    for plain, recomputed in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=1e-6)


def test_a_deep_copy_replays_on_its_own_routers(moe_model):
    model = copy.deepcopy(moe_model)
    assert routing_replay.install(model)
    twin = copy.deepcopy(model)
    routes = torch.zeros(1, 3, len(routing_replay.moe_routers(model)), 2, dtype=torch.long)
    routes[..., 1] = 1
    routing_replay.set_routes(twin, routes)
    assert all(r._rollflow_replay_routes is None for r in routing_replay.moe_routers(model))
    with torch.no_grad():
        twin(torch.tensor([[5, 6, 7]]))  # replays on twin's routers only
        with pytest.raises(ValueError, match="routing replay holds routes for 3 tokens"):
            twin(torch.tensor([[5, 6, 7, 8]]))
        routing_replay.set_routes(twin, None)
        twin(torch.tensor([[5, 6, 7, 8]]))


def test_routes_that_do_not_fit_the_model_are_refused(moe_model, sampled):
    model = copy.deepcopy(moe_model)
    routing_replay.install(model)
    layers = len(routing_replay.moe_routers(model))
    with pytest.raises(ValueError, match=f"{layers + 1} MoE layers"):
        routing_replay.set_routes(model, torch.zeros(1, 3, layers + 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="expert id 4"):
        routing_replay.set_routes(model, torch.full((1, 3, layers, 2), 4, dtype=torch.long))
    first = sampled[0][0]
    odd = TITOSample(**{f: getattr(first, f) for f in first.__struct_fields__ if f != "routed_experts"})
    odd.routed_experts = first.routed_experts[:, :1]
    with pytest.raises(ValueError, match="different"):
        routing_replay.collate_routes([first, odd], 40)


def test_a_dense_model_has_nothing_to_replay(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not routing_replay.install(model)


async def test_single_turn_samples_carry_the_engines_routes_to_the_trainer(moe_model, tiny_moe_model_dir):
    """``SingleTurnGenerator`` keeps each output's routes on its samples (it once dropped them, so single-turn
    runs trained without replay), and they are the routes the model itself takes on those tokens."""
    from rollflow.inference.client import LocalInferenceClient

    from .helpers.routes import assert_routes_reach_the_trainer, single_turn_group

    engine = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=4, max_model_len=256, return_routed_experts=True
    )
    try:
        group = await single_turn_group(LocalInferenceClient([engine]), tiny_moe_model_dir)
    finally:
        await engine.shutdown()
    assert_routes_reach_the_trainer(group, moe_model.config.num_hidden_layers, 2)
    for sample in group.samples:
        np.testing.assert_array_equal(sample.routed_experts, routes_of(moe_model, sample)[:-1])


async def test_agent_samples_carry_the_engines_routes_to_the_trainer(moe_model, tiny_moe_model_dir):
    """An agent's two-turn session through the TITO proxy (``AgentGenerator``): its composed sample carries a
    route row for each token, and the trainer's micro-batch holds them."""
    import openai

    from rollflow.config import ModelConfig
    from rollflow.inference.client import LocalInferenceClient
    from rollflow.messages import RolloutRequest
    from rollflow.models.loading import create_chat_renderer, load_tokenizer
    from rollflow.rollout.agent import AgentGenerator
    from rollflow.tito import TITOProxy

    from .helpers.routes import assert_routes_reach_the_trainer

    async def agent(base_url, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as api:
            messages = list(task.messages)
            for turn in range(2):
                reply = await api.chat.completions.create(
                    model=task.model, messages=messages, max_tokens=6, seed=task.seed + turn
                )
                messages += [reply.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": "again"}]
        return 1.0

    engine = TorchEngine(
        copy.deepcopy(moe_model), max_batch_size=4, max_model_len=256, return_routed_experts=True
    )
    tokenizer = load_tokenizer(tiny_moe_model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(), tiny_moe_model_dir)
    try:
        async with TITOProxy(
            LocalInferenceClient([engine]),
            renderer,
            tokenizer,
            model_name="rollflow:tiny-moe",
            return_routed_experts=True,
        ) as proxy:
            generator = AgentGenerator(proxy, agent, max_seq_len=256, timeout_s=60, seed=1)
            request = RolloutRequest(0, [{"role": "user", "content": "route me"}], answer=None, num_samples=2)
            group = await generator.generate_group(request)
    finally:
        await engine.shutdown()
    assert all(not sample.masked for sample in group.samples), [s.mask_reason for s in group.samples]
    assert_routes_reach_the_trainer(group, moe_model.config.num_hidden_layers, 2)
