"""Completion text for rewards and agents carries no special tokens, as ``skip_special_tokens`` decoding has it,
also with a model whose renderer is its tokenizer's chat template (``renderers``' generic ``default``)."""

from __future__ import annotations

import shutil

import pytest

from rollflow.config import ModelConfig, SamplingConfig
from rollflow.models.loading import create_chat_renderer, load_tokenizer
from rollflow.models.special_tokens import special_token_texts
from rollflow.rollout.generator import SingleTurnGenerator
from rollflow.tito.renderer import TITORenderer

# A random-init policy can sample any token; these are the ones the issue saw in completions.
SAMPLED = "Hello<|im_start|> World<|endoftext|>!<|im_end|>"


@pytest.fixture(scope="module")
def template_model(tmp_path_factory, tiny_model_dir):
    """The tiny model's files under a plain directory: ``auto`` finds no renderer by name, so the generic
    renderer renders with the tokenizer's chat template."""
    model_dir = tmp_path_factory.mktemp("template-model") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = load_tokenizer(model_dir)
    renderer = create_chat_renderer(tokenizer, ModelConfig(path=str(model_dir)), model_dir)
    return tokenizer, renderer


def test_the_template_renderer_is_the_generic_one(template_model):
    _, renderer = template_model
    assert type(renderer).__name__ == "DefaultRenderer"


def test_reward_text_has_no_special_tokens(template_model):
    tokenizer, renderer = template_model
    generator = SingleTurnGenerator(
        client=None, renderer=renderer, rewarder=None, sampling=SamplingConfig(), seed=0, tokenizer=tokenizer
    )
    prompt_ids = list(renderer.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    completion_ids = tokenizer.encode(SAMPLED, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in completion_ids
    text = generator.completion_text(prompt_ids, completion_ids)
    assert text == tokenizer.decode(completion_ids, skip_special_tokens=True) == "Hello World!"


def test_agent_reply_text_has_no_special_tokens(template_model):
    tokenizer, renderer = template_model
    completion_ids = tokenizer.encode(SAMPLED, add_special_tokens=False)
    parsed = TITORenderer(renderer, tokenizer).parse(completion_ids, None, prompt_ids=[])
    assert parsed.content == "Hello World!"


def test_reasoning_markers_and_added_tokens_stay(template_model):
    tokenizer, _ = template_model
    texts = special_token_texts(tokenizer)
    assert set(texts) == {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    assert "<think>" not in texts and "<tool_call>" not in texts
