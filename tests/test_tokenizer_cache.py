"""``load_tokenizer`` remembers short texts' ids: same answers as the tokenizer's own ``encode``, own lists."""

from __future__ import annotations

import pickle

from rollflow.models.loading import OffsetsProbeCache, ShortTextEncodeCache, load_tokenizer


def test_cached_encode_matches_the_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert isinstance(tokenizer.encode, ShortTextEncodeCache)
    plain = type(tokenizer).encode.__get__(tokenizer)
    texts = ["<|im_start|>assistant\n", "\n", "", "go on", "é ü 漢字", "x" * 65, "<think>"]
    for text in texts:
        for special in (True, False):
            for _ in range(2):  # the second call is answered from memory
                assert tokenizer.encode(text, add_special_tokens=special) == plain(
                    text, add_special_tokens=special
                )
    # Other arguments go to the tokenizer itself.
    assert tokenizer.encode("go on", return_tensors=None) == plain("go on", return_tensors=None)
    # Each caller gets its own list: changing one does not change the next answer.
    first = tokenizer.encode("go on", add_special_tokens=False)
    first.append(-1)
    assert tokenizer.encode("go on", add_special_tokens=False) == plain("go on", add_special_tokens=False)
    # A bounded memory: full, it starts over.
    small = ShortTextEncodeCache(tokenizer, max_entries=2)
    for text in ("a", "b", "c"):
        small(text)
    assert len(small._ids) == 1


def test_a_pickled_tokenizer_keeps_the_cached_encode(tiny_model_dir):
    tokenizer = pickle.loads(pickle.dumps(load_tokenizer(tiny_model_dir)))
    assert isinstance(tokenizer.encode, ShortTextEncodeCache)
    assert tokenizer.encode("go on", add_special_tokens=False) == type(tokenizer).encode(
        tokenizer, "go on", add_special_tokens=False
    )


def test_offsets_probe_is_remembered_and_calls_are_unchanged(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    probe = tokenizer.__dict__[
        "__call__"
    ]  # what getattr(tokenizer, "__call__") finds, as the renderers read it
    assert isinstance(probe, OffsetsProbeCache)
    plain = type(tokenizer).__call__.__get__(tokenizer)
    for _ in range(2):
        encoding = probe("a", add_special_tokens=False, return_offsets_mapping=True)
        expected = plain("a", add_special_tokens=False, return_offsets_mapping=True)
        assert encoding["input_ids"] == expected["input_ids"]
        assert encoding["offset_mapping"] == expected["offset_mapping"]
    encoding["input_ids"] = []  # a caller's change stays its own
    assert (
        probe("a", add_special_tokens=False, return_offsets_mapping=True)["input_ids"]
        == expected["input_ids"]
    )
    # tokenizer(...) goes to the class's __call__; long texts and other arguments are never remembered.
    text = "a longer text " * 10
    assert tokenizer(text)["input_ids"] == probe(text)["input_ids"] == plain(text)["input_ids"]
    assert probe("a", return_tensors=None)["input_ids"] == plain("a")["input_ids"]
    assert len(probe._encodings) == 1
