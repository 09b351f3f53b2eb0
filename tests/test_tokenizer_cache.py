"""``load_tokenizer`` remembers short texts' ids: same answers as the tokenizer's own ``encode``, own lists."""

from __future__ import annotations

import pickle

from rollflow.models.loading import ShortTextEncodeCache, load_tokenizer


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
