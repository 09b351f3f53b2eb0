"""Direct answers from a fast tokenizer's Rust backend for the call shapes chat renderers make on every turn.

transformers wraps each call to the ``tokenizers`` backend in Python: argument normalisation, padding and
truncation state, batching a single text and un-batching it again, ``BatchEncoding`` assembly. For the short
texts of a chat turn that wrapper costs more than the encoding itself, several times per turn. The renderers
call a few shapes only:

- ``tokenizer(text, add_special_tokens=<bool>, return_offsets_mapping=True)`` (``renderers``' one-pass encode
  with character offsets, and its probe of whether the tokenizer has offsets),
- ``tokenizer.decode(ids)`` with ``skip_special_tokens`` and at most ``clean_up_tokenization_spaces`` (reasoning
  boundaries, response parsing, stop strings, logprob token text),
- ``tokenizer.unk_token_id`` (read after every lookup of a reasoning marker; transformers answers it from
  ``__getattr__``, only after a failed attribute lookup).

``with_fast_paths`` gives a loaded tokenizer a subclass of its own class (made once per class, same name) whose
methods answer exactly those shapes from the backend, building what transformers builds, and hand every other
call to the class's own method. A shape is taken over only where the class uses transformers' own
implementation of everything that call goes through (a model's tokenizer class that overrides a step keeps its
own), and only while the backend is in the state transformers would put it in for that call (no truncation, no
padding, ``split_special_tokens`` as configured); otherwise the call goes the long way, which also restores
that state. Tokens added through transformers make the memories ``load_tokenizer`` puts on the tokenizer
(``ShortTextEncodeCache``, ``OffsetsProbeCache``) forget what they remembered. A pickled tokenizer unpickles
with the same fast class (tokenizers travel to worker processes).
"""

from __future__ import annotations

import threading
from typing import Any

_INT_ONLY = frozenset({int})

# One fast class per tokenizer class (None: the class is not a transformers fast tokenizer).
_FAST_CLASSES: dict[type, type | None] = {}
_FAST_CLASSES_LOCK = threading.Lock()


def with_fast_paths(tokenizer: Any) -> Any:
    """Switch ``tokenizer`` (in place) to the fast-path subclass of its class, when it is a transformers fast
    tokenizer; return it. Idempotent; tokenizers of other kinds are returned unchanged."""
    fast = fast_class(type(tokenizer))
    if fast is not None:
        tokenizer.__class__ = fast
    return tokenizer


def fast_class(base: type) -> type | None:
    """The fast-path subclass of tokenizer class ``base`` (itself when it already is one), made once; None
    when ``base`` is not a transformers fast (``tokenizers``-backed) tokenizer class."""
    if issubclass(base, FastPaths):
        return base
    with _FAST_CLASSES_LOCK:
        if base not in _FAST_CLASSES:
            _FAST_CLASSES[base] = _make_fast_class(base)
        return _FAST_CLASSES[base]


# transformers' ``BatchEncoding`` once ``_settable_batch_encoding`` has checked that ``BatchEncoding(data,
# [encoding])`` sets exactly ``data``, ``_encodings`` and ``_n_sequences`` (so those can be set directly);
# False when it sets anything else; None until checked.
_BATCH_ENCODING: Any = None


def copy_batch_encoding(batch: Any) -> Any:
    """A shallow copy of a ``BatchEncoding`` (its own dict of the same values, the same encodings) as
    ``batch.copy()`` makes, but without ``UserDict.copy``'s round trip through ``copy.copy`` (which also drops
    ``n_sequences``); anything else is ``batch.copy()``."""
    cls = _BATCH_ENCODING or _settable_batch_encoding()
    if cls and type(batch) is cls:
        return _batch_encoding(cls, dict(batch.data), batch._encodings, batch._n_sequences)
    return batch.copy()


def _batch_encoding(cls: type, data: dict, encodings: Any, n_sequences: Any) -> Any:
    batch = cls.__new__(cls)
    batch.data = data
    batch._encodings = encodings
    batch._n_sequences = n_sequences
    return batch


def _settable_batch_encoding() -> Any:
    global _BATCH_ENCODING
    if _BATCH_ENCODING is None:
        from collections import UserDict

        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from transformers.tokenization_utils_base import BatchEncoding

        encoding = Tokenizer(WordLevel({"a": 0}, unk_token="a")).encode("a")
        data = {"input_ids": encoding.ids, "offset_mapping": encoding.offsets}
        made = BatchEncoding(dict(data), [encoding])
        settable = (
            BatchEncoding.__setitem__ is UserDict.__setitem__
            and BatchEncoding.__setattr__ is object.__setattr__
            and vars(made) == {"data": data, "_encodings": [encoding], "_n_sequences": encoding.n_sequences}
        )
        _BATCH_ENCODING = BatchEncoding if settable else False
    return _BATCH_ENCODING


def _make_fast_class(base: type) -> type | None:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not issubclass(base, TokenizersBackend):
        return None

    def own(name: str, owner: type) -> bool:
        # The class runs transformers' own implementation of this step (not a model-specific override).
        return getattr(base, name, None) is getattr(owner, name)

    fast_call = (
        own("__call__", PreTrainedTokenizerBase)
        and own("_get_padding_truncation_strategies", PreTrainedTokenizerBase)
        and own("_encode_plus", TokenizersBackend)
        and own("set_truncation_and_padding", TokenizersBackend)
        and own("_convert_encoding", TokenizersBackend)
        # Encoder-decoder tokenizers switch between input and target modes on every call.
        and not hasattr(base, "_switch_to_input_mode")
    )
    fast_decode = own("decode", PreTrainedTokenizerBase) and own("_decode", TokenizersBackend)
    fast_unk_token_id = (
        own("__getattr__", PreTrainedTokenizerBase)
        and "unk_token" in getattr(base, "SPECIAL_TOKENS_ATTRIBUTES", ())
        and not hasattr(base, "unk_token_id")
    )
    namespace = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_fast_base": base,
        "_fast_call": fast_call,
        "_fast_decode": fast_decode,
        "_fast_unk_token_id": fast_unk_token_id,
    }
    # Same name as the class it extends: transformers writes ``type(tokenizer).__name__`` into saved configs.
    return type(base.__name__, (FastPaths, base), namespace)


class FastPaths:
    """Mixin placed before a transformers fast tokenizer class (see the module docstring); not used alone."""

    # Set per fast class by ``_make_fast_class``.
    _fast_base: type
    _fast_call: bool
    _fast_decode: bool
    _fast_unk_token_id: bool
    # Attributes of the instance, from transformers.
    _tokenizer: Any
    split_special_tokens: bool
    model_input_names: list[str]
    clean_up_tokenization_spaces: bool
    verbose: bool

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (
            self._fast_call
            and not args
            and type(text) is str
            and len(kwargs) == 2
            and kwargs.get("return_offsets_mapping") is True
            and type(kwargs.get("add_special_tokens")) is bool
        ):
            backend = self._tokenizer
            if (
                backend.truncation is None
                and backend.padding is None
                and backend.encode_special_tokens == self.split_special_tokens
            ):
                return self._encode_with_offsets(text, kwargs["add_special_tokens"])
        return super().__call__(text, *args, **kwargs)  # type: ignore[misc]

    def _add_tokens(self, *args: Any, **kwargs: Any) -> Any:
        # New tokens change how texts encode: the memories load_tokenizer put on the instance forget what they
        # remembered (every way transformers adds tokens comes through here).
        for method in ("encode", "__call__"):
            forget = getattr(self.__dict__.get(method), "forget", None)
            if forget is not None:
                forget()
        return super()._add_tokens(*args, **kwargs)  # type: ignore[misc]

    def _encode_with_offsets(self, text: str, add_special_tokens: bool) -> Any:
        # What transformers' __call__ -> _encode_plus -> _convert_encoding build for one text, unbatched.
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        input_ids = encoding.ids
        data: dict[str, Any] = {"input_ids": input_ids}
        names = self.model_input_names
        if "token_type_ids" in names:
            data["token_type_ids"] = encoding.type_ids
        if "attention_mask" in names:
            data["attention_mask"] = encoding.attention_mask
        data["offset_mapping"] = encoding.offsets
        self._eventual_warn_about_too_long_sequence(input_ids, None, True)  # type: ignore[attr-defined]
        cls = _BATCH_ENCODING or _settable_batch_encoding()
        if cls:
            # What ``BatchEncoding(data, [encoding])`` makes, without its per-key ``UserDict`` copy.
            return _batch_encoding(cls, data, [encoding], encoding.n_sequences)
        from transformers.tokenization_utils_base import BatchEncoding

        return BatchEncoding(data, [encoding])

    @property
    def unk_token_id(self) -> Any:
        # Renderers read it after every ``convert_tokens_to_ids`` of a marker; transformers answers it from
        # ``__getattr__`` (reached only after a failed lookup). This is that branch of ``__getattr__``.
        if self._fast_unk_token_id:
            token = self.__dict__.get("_special_tokens_map", {}).get("unk_token")
            if token is not None:
                return self.convert_tokens_to_ids(str(token))  # type: ignore[attr-defined]
            if not self.verbose:  # verbose: transformers logs that it is not set; let it
                return None
        return self._fast_base.__getattr__(self, "unk_token_id")  # type: ignore[attr-defined]

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if (
            self._fast_decode
            and type(token_ids) is list
            and (not kwargs or kwargs.keys() == {"clean_up_tokenization_spaces"})
        ):
            clean_up = kwargs.get("clean_up_tokenization_spaces")
            if clean_up is None:
                clean_up = self.clean_up_tokenization_spaces
            if not clean_up and {*map(type, token_ids)} <= _INT_ONLY:  # plain ints only (no bools, no numpy)
                return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return super().decode(token_ids, skip_special_tokens, **kwargs)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The fast class is made at run time, so pickle cannot name it: the object is pickled as one of its base
        # class (whose reduction names its class among the constructor's arguments) and made fast on loading.
        constructor, arguments, *rest = super().__reduce_ex__(protocol)
        arguments = tuple(self._fast_base if argument is type(self) else argument for argument in arguments)
        return (_unpickle_fast, (constructor, arguments), *rest)


def _unpickle_fast(constructor: Any, arguments: tuple) -> Any:
    return with_fast_paths(constructor(*arguments))
