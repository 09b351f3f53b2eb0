"""``load_tokenizer``'s fast paths answer exactly what transformers' own methods answer, survive pickling and
leave every other call shape (and model-specific overrides) to the tokenizer class."""

from __future__ import annotations

import copy
import json
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollflow.models.fast_tokenizer import FastPaths, fast_class, with_fast_paths
from rollflow.models.loading import load_tokenizer

TEXTS = [
    "",
    "a",
    "user\ntask 17: say something",
    "  leading and trailing  ",
    "tabs\tand\n\n\nnewlines\r\n and   runs     of spaces",
    "é ü 漢字 кириллица العربية",
    "emoji 👩‍👩‍👧‍👦 🎉🎉 and a lone \u200d joiner",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|endoftext|><|im_end|>",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    "word " * 3000,  # longer than the model's maximum length: transformers warns, the tokens are the same
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    """The fast-path tokenizer and transformers' own methods on it, as callables."""
    tokenizer = load_tokenizer(tiny_model_dir)
    assert isinstance(tokenizer, FastPaths)
    return tokenizer, tokenizer._fast_base


def _same_encoding(fast, slow) -> None:
    assert type(fast) is type(slow)
    assert fast.data == slow.data
    assert list(fast.keys()) == list(slow.keys())  # same keys in the same order
    assert fast.n_sequences == slow.n_sequences
    assert [e.ids for e in fast.encodings] == [e.ids for e in slow.encodings]
    assert [e.offsets for e in fast.encodings] == [e.offsets for e in slow.encodings]


def test_offsets_call_matches_transformers(tokenizers):
    tokenizer, base = tokenizers
    for text in TEXTS:
        for special in (False, True):
            slow = base.__call__(tokenizer, text, add_special_tokens=special, return_offsets_mapping=True)
            fast = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
            _same_encoding(fast, slow)
            assert (fast["offset_mapping"] and fast["input_ids"]) or text == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=80) | st.sampled_from(TEXTS[:-1]))
def test_offsets_call_matches_transformers_on_any_text(tokenizers, text):
    tokenizer, base = tokenizers
    fast = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    _same_encoding(
        fast, base.__call__(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
    )


def test_other_call_shapes_go_to_transformers(tokenizers, monkeypatch):
    tokenizer, base = tokenizers
    text = "go on"
    shapes = [
        ((text,), {}),
        ((text,), {"add_special_tokens": False}),
        ((text,), {"add_special_tokens": False, "return_offsets_mapping": False}),
        (
            (text,),
            {"add_special_tokens": False, "return_offsets_mapping": True, "return_attention_mask": False},
        ),
        ((text, "pair"), {"add_special_tokens": False, "return_offsets_mapping": True}),
        (([text, "x"],), {"add_special_tokens": False, "return_offsets_mapping": True}),
    ]
    expected = [base.__call__(tokenizer, *args, **kwargs) for args, kwargs in shapes]
    seen = []
    original = base._encode_plus
    monkeypatch.setattr(base, "_encode_plus", lambda self, *a, **k: seen.append(k) or original(self, *a, **k))
    for (args, kwargs), answer in zip(shapes, expected, strict=True):
        _same_encoding(tokenizer(*args, **kwargs), answer)
    assert len(seen) == len(shapes)  # every call above went the long way
    tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert len(seen) == len(shapes)  # the renderers' shape did not


def test_backend_state_transformers_would_reset_is_respected(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    base = tokenizer._fast_base
    text = "one two three four five six seven"
    expected = base.__call__(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
    # Someone left truncation or padding switched on in the backend: transformers switches it off per call.
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    _same_encoding(tokenizer(text, add_special_tokens=False, return_offsets_mapping=True), expected)
    tokenizer.backend_tokenizer.enable_padding(length=50)
    _same_encoding(tokenizer(text, add_special_tokens=False, return_offsets_mapping=True), expected)
    # split_special_tokens is honoured: special-token text is then split like any text.
    special = "<|im_start|>user"
    tokenizer.split_special_tokens = True
    split = tokenizer(special, add_special_tokens=False, return_offsets_mapping=True)
    _same_encoding(
        split, base.__call__(tokenizer, special, add_special_tokens=False, return_offsets_mapping=True)
    )
    _same_encoding(
        tokenizer(special, add_special_tokens=False, return_offsets_mapping=True),
        base.__call__(tokenizer, special, add_special_tokens=False, return_offsets_mapping=True),
    )
    tokenizer.split_special_tokens = False
    whole = tokenizer(special, add_special_tokens=False, return_offsets_mapping=True)
    assert len(whole["input_ids"]) < len(split["input_ids"])
    _same_encoding(
        whole, base.__call__(tokenizer, special, add_special_tokens=False, return_offsets_mapping=True)
    )


def test_decode_matches_transformers(tokenizers):
    tokenizer, base = tokenizers
    rng = random.Random(0)
    special_ids = list(tokenizer.all_special_ids)
    id_lists = [[], [special_ids[0]], special_ids, *(tokenizer.encode(text) for text in TEXTS)]
    id_lists += [rng.sample(range(len(tokenizer)), 12) + special_ids[:2] for _ in range(20)]
    for ids in id_lists:
        for kwargs in (
            {},
            {"skip_special_tokens": True},
            {"skip_special_tokens": False},
            {"skip_special_tokens": False, "clean_up_tokenization_spaces": False},
            {"skip_special_tokens": True, "clean_up_tokenization_spaces": None},
            {"clean_up_tokenization_spaces": True},
        ):
            assert tokenizer.decode(ids, **kwargs) == base.decode(tokenizer, ids, **kwargs)
    # Shapes the fast path leaves alone give transformers' answers too.
    ids = tokenizer.encode("héllo wörld")
    assert tokenizer.decode(np.array(ids)) == base.decode(tokenizer, np.array(ids))
    assert tokenizer.decode([np.int64(i) for i in ids]) == base.decode(tokenizer, ids)
    assert tokenizer.decode(ids[0]) == base.decode(tokenizer, ids[0])
    assert tokenizer.decode([ids, ids[:1]]) == base.decode(tokenizer, [ids, ids[:1]])
    assert tokenizer.decode([True, *ids]) == base.decode(tokenizer, [True, *ids])
    assert tokenizer.decode((*ids,)) == base.decode(tokenizer, (*ids,))


def test_pickled_and_copied_tokenizers_keep_the_fast_paths(tokenizers):
    tokenizer, base = tokenizers
    text = "é 👋 <|im_end|> go on"
    expected = base.__call__(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
    copies = [
        pickle.loads(pickle.dumps(tokenizer, protocol=p)) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)
    ]
    copies += [copy.deepcopy(tokenizer), copy.copy(tokenizer)]
    for other in copies:
        assert type(other) is type(tokenizer)
        _same_encoding(other(text, add_special_tokens=False, return_offsets_mapping=True), expected)
        assert other.decode(expected["input_ids"]) == text
        assert other.encode(text, add_special_tokens=False) == expected["input_ids"]


def test_fast_class_is_made_once_and_keeps_the_name(tokenizers, tiny_model_dir, tmp_path):
    tokenizer, base = tokenizers
    assert fast_class(base) is type(tokenizer) is fast_class(type(tokenizer))
    assert type(tokenizer).__name__ == base.__name__
    assert with_fast_paths(tokenizer) is tokenizer and type(tokenizer) is fast_class(base)
    # Saved as its own class: the saved config names the transformers class, not a rollflow one.
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path / "fast")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "fast" / "tokenizer_config.json").read_text())
    assert config == json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    # Something that is not a transformers fast tokenizer is left as it is.
    plain = object()
    assert with_fast_paths(plain) is plain and fast_class(object) is None


def test_a_class_that_overrides_a_step_keeps_its_own(tiny_model_dir):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Overriding(TokenizersBackend):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "overridden"

        def _encode_plus(self, *args, **kwargs):
            encoding = super()._encode_plus(*args, **kwargs)
            encoding["input_ids"] = [-1]
            return encoding

    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.__class__ = Overriding
    with_fast_paths(tokenizer)
    assert isinstance(tokenizer, FastPaths) and isinstance(tokenizer, Overriding)
    assert tokenizer.decode([1, 2]) == "overridden"
    assert tokenizer("go on", add_special_tokens=False, return_offsets_mapping=True)["input_ids"] == [-1]


def test_decode_with_clean_up_goes_to_transformers(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    base = tokenizer._fast_base
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer.encode("hello , world . isn 't it", add_special_tokens=False)
    cleaned = base.decode(tokenizer, ids, clean_up_tokenization_spaces=True)
    assert cleaned != tokenizer.decode(ids, clean_up_tokenization_spaces=False)  # the clean-up changes text
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=True) == cleaned
    tokenizer.clean_up_tokenization_spaces = True  # the tokenizer's own default applies when none is given
    assert tokenizer.decode(ids) == cleaned == tokenizer.decode(ids, clean_up_tokenization_spaces=None)


def test_unk_token_id_matches_transformers(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    slow = tokenizer._fast_base.__getattr__
    assert tokenizer.unk_token_id is None is slow(tokenizer, "unk_token_id")  # the tiny model has none
    tokenizer.unk_token = "<|endoftext|>"
    assert (
        tokenizer.unk_token_id
        == slow(tokenizer, "unk_token_id")
        == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    )
    tokenizer.unk_token_id = tokenizer.convert_tokens_to_ids(
        "<|im_end|>"
    )  # set through the id, as transformers allows
    assert tokenizer.unk_token == "<|im_end|>"
    assert tokenizer.unk_token_id == slow(tokenizer, "unk_token_id")
    assert tokenizer.convert_tokens_to_ids("no such token anywhere") == tokenizer.unk_token_id


def test_copied_batch_encoding_is_what_copy_makes(tokenizers):
    from rollflow.models.fast_tokenizer import copy_batch_encoding

    tokenizer, _ = tokenizers
    original = tokenizer("go on", add_special_tokens=False, return_offsets_mapping=True)
    copied = copy_batch_encoding(original)
    assert type(copied) is type(original) and copied is not original
    assert copied.data == original.data and copied.data is not original.data
    assert copied.encodings is original.encodings and copied.n_sequences == original.n_sequences == 1
    copied["input_ids"] = []  # a caller's change of a key stays its own, as with .copy()
    assert original["input_ids"]
    assert copy_batch_encoding({"a": 1}) == {"a": 1}


def test_added_tokens_make_the_tokenizer_memories_forget(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    base = tokenizer._fast_base
    text = "user\ngo on"
    before = tokenizer.encode(text, add_special_tokens=False)
    probe = tokenizer.__dict__["__call__"]  # the renderers' offsets probe (OffsetsProbeCache)
    probe(text, add_special_tokens=False, return_offsets_mapping=True)
    tokenizer.add_tokens(["go on"])
    assert tokenizer.encode(text, add_special_tokens=False) == base.encode(
        tokenizer, text, add_special_tokens=False
    )
    assert tokenizer.encode(text, add_special_tokens=False) != before
    after = probe(text, add_special_tokens=False, return_offsets_mapping=True)
    _same_encoding(
        after, base.__call__(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
    )
    assert after["input_ids"][-1] == tokenizer.convert_tokens_to_ids("go on")


def test_a_tokenizer_pickled_to_a_fresh_process_is_fast_there(tokenizers):
    """As when tokenizers travel to worker processes: the receiving interpreter never made the fast class."""
    import subprocess
    import sys

    tokenizer, base = tokenizers
    text = "é 👋 <|im_end|> go on"
    expected = base.__call__(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
    script = (
        "import pickle, sys\n"
        "tokenizer = pickle.load(sys.stdin.buffer)\n"
        "from rollflow.models.fast_tokenizer import FastPaths\n"
        "encoding = tokenizer(sys.argv[1], add_special_tokens=False, return_offsets_mapping=True)\n"
        "print(isinstance(tokenizer, FastPaths), type(tokenizer).__name__, encoding['input_ids'],\n"
        "      [list(span) for span in encoding['offset_mapping']], tokenizer.decode(encoding['input_ids']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, text], input=pickle.dumps(tokenizer), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    offsets = [list(span) for span in expected["offset_mapping"]]
    assert done.stdout.decode().strip() == (f"True {base.__name__} {expected['input_ids']} {offsets} {text}")
