"""Trainers and train batches for the trainer tests: the packing trainer, random groups, exact logprobs."""

from __future__ import annotations

import copy
import random

import torch

from rollflow.config import TrainerConfig
from rollflow.messages import FinishReason, Sample, ScoredGroup, TrainBatch
from rollflow.orchestrator.packing import pack_for_trainer
from rollflow.train.trainer import Trainer


class PackingTrainer(Trainer):
    """The trainer fed as the orchestrator feeds it: a ``TrainBatch`` goes through the batch packer first."""

    def train_step(self, batch, policy_version=None):
        if isinstance(batch, TrainBatch):
            batch = pack_for_trainer(batch, self.config, self.world_size)
        return super().train_step(batch, policy_version)


def make_trainer(model, temperature: float = 1.0, **config) -> Trainer:
    return PackingTrainer(
        model,
        TrainerConfig(**config),
        temperature=temperature,
        pad_token_id=model.config.pad_token_id,
        seed=0,
    )


@torch.no_grad()
def redraw_matrices(model, seed: int = 1, std: float = 0.3):
    """``model`` with every weight matrix re-drawn from N(0, std) (seeded), in place: the tiny model's random
    init is near uniform, and re-drawn weights make its distributions (and any error in them) show."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.dim() == 2:
            param.normal_(0.0, std, generator=generator)
    return model


@torch.no_grad()
def behaviour_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """What a sampler records: one unpadded HF forward, independent of the trainer's code."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) + j - 1, token].item() for j, token in enumerate(completion)]


def make_sample(prompt, completion, logprobs, *, reward=0.0, masked=False, index=0, sample_index=0) -> Sample:
    return Sample(
        prompt_index=index,
        sample_index=sample_index,
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        logprobs=list(logprobs),
        policy_versions=[0] * len(completion),
        finish_reason=FinishReason.STOP,
        reward=reward,
        masked=masked,
    )


def make_batch(model, seed: int = 0, groups: int = 3, group_size: int = 4, temperature: float = 1.0):
    """Groups of random prompts and completions of varied lengths, with exact behaviour logprobs."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    scored = []
    for index in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        samples = []
        for sample_index in range(group_size):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            logprobs = behaviour_logprobs(model, prompt, completion, temperature)
            samples.append(
                make_sample(
                    prompt, completion, logprobs, reward=rng.random(), index=index, sample_index=sample_index
                )
            )
        scored.append(ScoredGroup(prompt_index=index, samples=samples))
    return TrainBatch(step=0, groups=scored)


# ---------------------------------------------------------------- off-policy: another policy version


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy of ``model`` with deterministic noise on every weight: another policy version."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return other


@torch.no_grad()
def logprobs_of(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The sampled tokens' logprobs from one unpadded forward, independent of the trainer's code."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    return [logp[len(prompt) + j - 1, token].item() for j, token in enumerate(completion)]


def make_behaviour_batch(behaviour_model, seed: int = 0, groups: int = 2, group_size: int = 3) -> TrainBatch:
    """Random prompts and completions whose behaviour logprobs come from ``behaviour_model`` (version 0)."""
    rng = random.Random(seed)
    vocab = behaviour_model.config.vocab_size
    scored = []
    for index in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
        samples = []
        for sample_index in range(group_size):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(2, 8))]
            samples.append(
                Sample(
                    prompt_index=index,
                    sample_index=sample_index,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    logprobs=logprobs_of(behaviour_model, prompt, completion),
                    policy_versions=[0] * len(completion),
                    finish_reason=FinishReason.STOP,
                    reward=rng.random(),
                )
            )
        scored.append(ScoredGroup(prompt_index=index, samples=samples))
    return TrainBatch(step=0, groups=scored)


def make_off_policy_trainer(model, off_policy: str, **config) -> Trainer:
    config.setdefault("max_grad_norm", 1e6)  # keep param.grad the raw gradient
    return PackingTrainer(
        model, TrainerConfig(**config), pad_token_id=model.config.pad_token_id, off_policy=off_policy
    )


def completion_samples(texts: list[str]) -> list[Sample]:
    """One-token samples of one prompt whose completions read ``texts``: what a reward function scores."""
    return [
        Sample(
            prompt_index=0,
            sample_index=index,
            prompt_token_ids=[1],
            completion_token_ids=[2],
            logprobs=[0.0],
            policy_versions=[0],
            finish_reason=FinishReason.STOP,
            completion_text=text,
        )
        for index, text in enumerate(texts)
    ]


def assert_same_first_step(trainer, reference, *, grad_atol: float = 1e-5, weight_atol: float = 1e-6) -> None:
    """Two trainers that started from the same weights took the same first optimizer step: the same
    gradients (kept in ``param.grad`` after a step), and the same weights wherever the step was decided.

    Adam's first step moves each weight by ``lr * g / (|g| + eps)``: ``±lr`` for a gradient well above
    ``eps``, but anywhere in ``[-lr, lr]`` for one within float rounding of zero, where two sums of the same
    gradient may even differ in sign. So weights are compared closely where both gradients are clearly
    non-zero, and elsewhere only within Adam's bound of two steps.
    """
    lr = reference.optimizer.param_groups[0]["lr"]
    params = dict(trainer.model.named_parameters())
    for name, expected in reference.model.named_parameters():
        actual = params[name]
        if expected.grad is None:
            assert actual.grad is None, name
            continue
        grad, expected_grad = actual.grad.detach().cpu(), expected.grad.detach().cpu()
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=grad_atol, msg=f"{name}.grad")
        weight, expected_weight = actual.detach().cpu(), expected.detach().cpu()
        decided = (grad.abs() > 10 * grad_atol) & (expected_grad.abs() > 10 * grad_atol)
        torch.testing.assert_close(
            weight[decided], expected_weight[decided], rtol=0, atol=weight_atol, msg=f"{name} (decided)"
        )
        assert (weight - expected_weight).abs().max() <= 2 * lr * (1 + 1e-5), name
