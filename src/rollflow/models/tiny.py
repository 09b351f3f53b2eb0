"""The embedded models: the default ``rollflow:tiny``, its mixture-of-experts sibling ``rollflow:tiny-moe``, and
their vLLM-servable twins ``rollflow:tiny-h32`` and ``rollflow:tiny-moe-h32``.

A Qwen3-format byte-level BPE tokenizer trained in-process on generated text, and a tiny random-init
``Qwen3ForCausalLM`` (about 230k parameters). Both are built once, deterministically, into a user cache
directory, so a CPU-only machine with no network can run the quickstart. ``rollflow:tiny-moe`` is a
random-init ``Qwen3MoeForCausalLM`` of the same shape with the same tokenizer: every layer's MLP is 4 experts
of which each token is routed to 2, so MoE routing (routed-expert replay) can be exercised on a CPU.

The ``-h32`` twins have the same size, tokenizer and MLPs but 2 attention heads of 32 dimensions (1 KV head)
instead of 4 of 16: vLLM's CPU attention serves head sizes of 32 and up only (head_dim 16 loads, then its
engine core dies on the first request), so these are the models a CPU vLLM can serve. ``rollflow:tiny``
itself stays as it is, so the figures measured on it (the quickstart's learning curve) hold.

``rollflow:tiny-long`` is ``rollflow:tiny`` itself (the same files, the same weights) with room for
``TINY_LONG_POSITIONS`` positions instead of 2048: agent harnesses (Claude Code, Codex CLI, opencode) send
system prompts and tool schemas of 20-60k of its tokens. Its rotary embedding does not depend on the length,
so every position tiny has gives the same logprobs in both.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

TINY_MODEL_NAME = "rollflow:tiny"
TINY_MOE_MODEL_NAME = "rollflow:tiny-moe"
TINY_H32_MODEL_NAME = "rollflow:tiny-h32"
TINY_MOE_H32_MODEL_NAME = "rollflow:tiny-moe-h32"
TINY_LONG_MODEL_NAME = "rollflow:tiny-long"
TINY_LONG_POSITIONS = 131_072
# Bump when the corpus, the tokenizer recipe or the architecture changes: old caches are then ignored.
TINY_BUILD_VERSION = 1
TINY_MOE_BUILD_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens that renderers' Qwen3 renderer requires to be single tokens.
ADDED_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
# Qwen2/Qwen3 pre-tokenization pattern.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_ARCHITECTURE = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)

# The MoE sibling: the tiny attention stack, every MLP replaced by a sparse block of 4 small experts, top-2.
TINY_MOE_ARCHITECTURE = dict(
    TINY_ARCHITECTURE,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
# vLLM-servable attention (see the module docstring): same hidden size, heads of 32.
H32_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
TINY_H32_ARCHITECTURE = dict(TINY_ARCHITECTURE, **H32_ATTENTION)
TINY_MOE_H32_ARCHITECTURE = dict(TINY_MOE_ARCHITECTURE, **H32_ATTENTION)
# Router weights are drawn at this std instead of the init's 0.02, so router logits differ by whole units and
# the top-2 choice does not flip between two forwards that differ only in float rounding.
TINY_MOE_ROUTER_STD = 0.5

CHAT_TEMPLATE = """\
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.reasoning_content is defined and message.reasoning_content -%}
<think>
{{ message.reasoning_content }}
</think>

{% endif -%}
{{ message.content or '' }}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false -%}
<think>

</think>

{% endif -%}
{%- endif -%}"""

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "light",
    "water",
    "horse",
    "table",
    "paper",
    "music",
    "house",
    "night",
    "yellow",
    "window",
    "garden",
    "bread",
    "silver",
    "planet",
    "winter",
    "summer",
    "orange",
    "forest",
    "ocean",
    "mountain",
    "little",
    "quick",
    "happy",
    "bright",
    "quiet",
    "brave",
    "gentle",
    "simple",
    "answer",
    "question",
    "number",
    "letter",
    "word",
    "reply",
    "write",
    "say",
    "name",
    "give",
    "tell",
    "list",
    "color",
    "animal",
    "fruit",
    "city",
    "friend",
    "story",
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "bird",
    "fish",
    "red",
    "blue",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "yes",
    "no",
    "ok",
]
PROMPT_PHRASES = [
    "Reply in uppercase.",
    "Reply in lowercase.",
    "Answer in UPPERCASE letters.",
    "answer in lowercase letters.",
    "Say a word.",
    "Name a fruit.",
    "Name an animal.",
    "Name a color.",
    "Write a number.",
]


def _corpus(num_lines: int, seed: int) -> list[str]:
    """Generated training text: words in every case, digits, arithmetic and chat markup."""
    rng = random.Random(seed)
    lines = []
    for index in range(num_lines):
        words = rng.choices(WORDS, k=rng.randint(2, 10))
        style = index % 4
        if style == 0:
            words = [word.upper() for word in words]
        elif style == 1:
            words = [word.capitalize() for word in words]
        text = " ".join(words)
        kind = index % 7
        if kind == 0:
            text = f"{rng.choice(PROMPT_PHRASES)} {text}"
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            text = f"{a} + {b} = {a + b}. {text}"
        elif kind == 2:
            text = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        elif kind == 3:
            text = f'{{"name": "{words[0].lower()}", "arguments": {{"x": {rng.randint(0, 9)}}}}}'
        lines.append(text)
    return lines


def build_tokenizer():
    """Train the Qwen3-format BPE tokenizer; deterministic for a given build version."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1536,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(40_000, seed=TINY_BUILD_VERSION), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
    )
    fast.add_tokens(ADDED_TOKENS, special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = TINY_ARCHITECTURE["max_position_embeddings"]
    return fast


def build_model(
    vocab_size: int, eos_token_id: int, pad_token_id: int, architecture: dict = TINY_ARCHITECTURE
):
    """A random-init ``Qwen3ForCausalLM`` with the tiny architecture (seeded, so deterministic)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **architecture,
    )
    with torch.random.fork_rng():
        torch.manual_seed(TINY_BUILD_VERSION)
        model = Qwen3ForCausalLM(config)
    return model


def build_moe_model(
    vocab_size: int, eos_token_id: int, pad_token_id: int, architecture: dict = TINY_MOE_ARCHITECTURE
):
    """A random-init ``Qwen3MoeForCausalLM`` with the tiny MoE architecture (seeded, so deterministic)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **architecture,
    )
    with torch.random.fork_rng():
        torch.manual_seed(TINY_MOE_BUILD_VERSION)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, TINY_MOE_ROUTER_STD)
    return model


def cache_dir() -> Path:
    """Where built models live: ``$ROLLFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollflow``, else ``~/.cache/rollflow``."""
    if explicit := os.environ.get("ROLLFLOW_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rollflow"


def ensure_tiny_model() -> Path:
    """Return the directory of the built tiny model, building it on first use."""
    return _ensure_built(cache_dir() / f"tiny-v{TINY_BUILD_VERSION}", _write_tiny)


def ensure_tiny_moe_model() -> Path:
    """Return the directory of the built tiny MoE model (tiny's tokenizer), building it on first use."""
    return _ensure_built(cache_dir() / f"tiny-moe-v{TINY_MOE_BUILD_VERSION}", _write_tiny_moe)


def ensure_tiny_h32_model() -> Path:
    """Return the directory of ``rollflow:tiny-h32`` (tiny with heads of 32), building it on first use."""
    return _ensure_built(cache_dir() / f"tiny-h32-v{TINY_BUILD_VERSION}", _write_tiny_h32)


def ensure_tiny_moe_h32_model() -> Path:
    """Return the directory of ``rollflow:tiny-moe-h32`` (tiny-moe with heads of 32), building it on first use."""
    return _ensure_built(cache_dir() / f"tiny-moe-h32-v{TINY_MOE_BUILD_VERSION}", _write_tiny_moe_h32)


def ensure_tiny_long_model() -> Path:
    """Return the directory of ``rollflow:tiny-long`` (tiny with 131072 positions), building it on first use."""
    return _ensure_built(cache_dir() / f"tiny-long-v{TINY_BUILD_VERSION}", _write_tiny_long)


def _write_tiny(staging: Path) -> None:
    tokenizer = build_tokenizer()
    _save(tokenizer, build_model(**_token_ids(tokenizer)), staging)


def _tiny_tokenizer():
    """rollflow:tiny's tokenizer; loading the built one skips training it a second time."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def _write_tiny_long(staging: Path) -> None:
    import json

    source = ensure_tiny_model()
    for file in source.iterdir():
        if file.is_file():
            shutil.copyfile(file, staging / file.name)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        settings = json.loads((staging / name).read_text())
        settings[key] = TINY_LONG_POSITIONS
        (staging / name).write_text(json.dumps(settings, indent=2))


def _write_tiny_moe(staging: Path) -> None:
    tokenizer = _tiny_tokenizer()
    _save(tokenizer, build_moe_model(**_token_ids(tokenizer)), staging)


def _write_tiny_h32(staging: Path) -> None:
    tokenizer = _tiny_tokenizer()
    _save(tokenizer, build_model(**_token_ids(tokenizer), architecture=TINY_H32_ARCHITECTURE), staging)


def _write_tiny_moe_h32(staging: Path) -> None:
    tokenizer = _tiny_tokenizer()
    _save(
        tokenizer, build_moe_model(**_token_ids(tokenizer), architecture=TINY_MOE_H32_ARCHITECTURE), staging
    )


def _token_ids(tokenizer) -> dict[str, int]:
    return dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def _save(tokenizer, model, staging: Path) -> None:
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    tokenizer.save_pretrained(staging)
    model.save_pretrained(staging)


def _ensure_built(target: Path, write: Callable[[Path], None]) -> Path:
    """Return ``target``, first running ``write`` into a fresh directory if it has no ``config.json``.

    The build goes to a temporary directory and is renamed into place, so concurrent first uses
    (parallel tests, several servers) never see a half-written model.
    """
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its build is identical.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("built tiny model", path=str(target))
    return target
