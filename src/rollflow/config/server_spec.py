"""``ServerSpec``: the options of one inference server rollflow starts, as data.

Each field is one option, declared once with the flag it becomes on each engine's command line
(``rollflow serve`` for the torch engine, ``vllm serve`` for vLLM) and, where an engine cannot honour it, the
values that engine accepts. Everything else is derived from the fields:

- ``ServerSpec.from_inference``: the spec of ``[inference]`` (each field is the ``inference`` key of its name);
- ``argv(engine)``: the flags of the option values, for the command builders of
  ``rollflow.launch.server_group``;
- ``add_serve_arguments``: the flags ``rollflow serve`` parses;
- ``managed_flags()`` and ``engine_refusals``: the validation of ``inference.server_args`` and of what the
  chosen engine cannot do.

Adding a server option is one field here (and its ``[inference]`` key, which users set). A ``None`` or
default value adds no flag: the server keeps its own default. Importing this module never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

Engine = Literal["torch", "vllm"]


@dataclasses.dataclass(frozen=True)
class ServerOption:
    """How one ``ServerSpec`` field reaches each engine."""

    torch: str | None = None
    """Flag of ``rollflow serve``; None: the torch engine has no such option."""
    vllm: str | None = None
    """Flag of ``vllm serve``; None: not passed to vLLM."""
    aliases: tuple[str, ...] = ()
    """Other spellings of the flag, refused in ``inference.server_args`` too (vLLM's ``-tp``)."""
    always: bool = False
    """Passed at its default value too (vLLM's ``--tensor-parallel-size``, which vLLM reads positionally)."""
    torch_accepts: tuple[Any, ...] | None = None
    """Values the torch engine takes for an option it has no flag for (None: any; it ignores the option)."""
    torch_refusal: str = ""
    """Why the torch engine refuses other values, and the fix."""
    vllm_accepts: tuple[Any, ...] | None = None
    """Values vLLM takes for an option it has no flag for (None: any; it ignores the option)."""
    vllm_refusal: str = ""
    """Why vLLM refuses other values, and the fix."""
    help: str = ""
    """``rollflow serve --help`` text (torch flags only)."""
    parse: Callable[[str], Any] | None = None
    """How ``rollflow serve`` reads the flag (None: as the field's type), raising ``argparse.ArgumentTypeError``."""


def _option(**kwargs: Any) -> ServerOption:
    return ServerOption(**kwargs)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], e.g. 0.125; got {text!r}")
    return value


#: Flags the command builders set from elsewhere than the spec, and the key that sets each ("": none, rollflow
#: picks it); refused in ``inference.server_args`` with the spec's own flags.
FIXED_FLAGS: dict[str, str] = {
    "--host": "",
    "--port": "",
    "--model": "model.path",
    "--served-model-name": "model.path",
    "--data-parallel-size": "inference.num_servers",
    "--api-key": "inference.api_key",
    "--weight-transfer-config": "weight_sync.strategy",
}


class ServerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The options of one managed inference server (see the module docstring)."""

    tensor_parallel_size: Annotated[
        int,
        _option(
            vllm="--tensor-parallel-size",
            aliases=("-tp",),
            always=True,
            torch_accepts=(1,),
            torch_refusal="rollflow's torch engine runs each server on one device; set it to 1, or use more "
            "servers (inference.num_servers)",
        ),
    ] = 1
    max_model_len: Annotated[
        int | None,
        _option(
            torch="--max-model-len",
            vllm="--max-model-len",
            help="prompt plus output tokens per request (default: the model's, at most 2048)",
        ),
    ] = None
    max_batch_size: Annotated[
        int | None,
        _option(
            torch="--max-batch-size",
            vllm="--max-num-seqs",
            help="KV-cache slots: requests decoded together (default 64)",
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float | None,
        _option(
            vllm="--gpu-memory-utilization",
            torch_accepts=(None,),
            torch_refusal="the torch engine sizes its KV cache from inference.max_batch_size and "
            "inference.max_model_len; remove it",
        ),
    ] = None
    dtype: Annotated[
        str,
        _option(
            vllm="--dtype",
            torch_accepts=("auto", "float32"),
            torch_refusal="rollflow's torch engine computes in float32; set inference.dtype = 'auto' or 'float32'",
        ),
    ] = "auto"
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        _option(
            torch="--device",
            help="where the engine runs: auto (CUDA when torch sees a GPU, else CPU), cpu or cuda (default auto)",
        ),
    ] = "auto"
    colocate: Annotated[bool, _option(vllm="--enable-sleep-mode")] = False
    return_routed_experts: Annotated[
        bool,
        _option(
            torch="--enable-return-routed-experts",
            vllm="--enable-return-routed-experts",
            help="MoE models: return each token's routed experts in generate responses (vLLM's flag)",
        ),
    ] = False
    max_request_share: Annotated[
        float | None,
        _option(
            torch="--max-request-share",
            parse=_share,
            vllm_accepts=(None,),
            vllm_refusal="it is the torch engine's latency-first cap; vLLM schedules its batch itself "
            "(its --max-num-batched-tokens bounds a step); remove it",
            help="latency first: while other requests are in the engine, no request holds more than this "
            "share of the batch's slots (default: off, throughput first)",
        ),
    ] = None
    # The program and first arguments of a vLLM server (``inference.vllm_command``); not a flag.
    vllm_command: Annotated[tuple[str, ...], _option()] = ("vllm", "serve")
    # The --http-* flags are parsed by ``rollflow.cli`` for ``rollflow serve`` and ``rollflow router`` alike.
    http_header_timeout_s: Annotated[float | None, _option(torch="--http-header-timeout-s")] = None
    http_body_timeout_s: Annotated[float | None, _option(torch="--http-body-timeout-s")] = None
    http_max_connections: Annotated[int | None, _option(torch="--http-max-connections")] = None

    @classmethod
    def from_inference(cls, inference: Any) -> ServerSpec:
        """The spec of an ``InferenceConfig``: each field is the ``inference`` key of the same name."""
        values = {name: getattr(inference, name) for name in cls.__struct_fields__}
        return cls(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()})

    def argv(self, engine: Engine) -> list[str]:
        """The flags of this spec on ``engine``'s command line, in field order."""
        argv: list[str] = []
        for name, option in _OPTIONS.items():
            flag = getattr(option, engine)
            value = getattr(self, name)
            if flag is None or (value == _DEFAULTS[name] and not option.always):
                continue
            if isinstance(value, bool):
                argv.append(flag)
            else:
                argv += [flag, str(value)]
        return argv

    def engine_refusals(self, engine: Engine) -> list[tuple[str, Any, str]]:
        """``(field, value, why)`` for each option ``engine`` cannot honour at its value."""
        refusals = []
        for name, option in _OPTIONS.items():
            accepts, why = (
                (option.torch_accepts, option.torch_refusal)
                if engine == "torch"
                else (option.vllm_accepts, option.vllm_refusal)
            )
            if accepts is not None and getattr(self, name) not in accepts:
                refusals.append((name, getattr(self, name), why))
        return refusals


def managed_flags() -> dict[str, str]:
    """Every flag rollflow sets on the servers it starts, with the config key that sets it ("": none);
    ``inference.server_args`` may not repeat them."""
    flags = dict(FIXED_FLAGS)
    for name, option in _OPTIONS.items():
        for flag in (option.torch, option.vllm, *option.aliases):
            if flag is not None:
                flags.setdefault(flag, f"inference.{name}")
    return flags


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the spec's ``rollflow serve`` flags that have help text (the ``--http-*`` ones are added with the
    router's) to ``parser``; each flag's destination is its field's name."""
    for name, option in _OPTIONS.items():
        if option.torch is None or not option.help:
            continue
        hint = typing.get_type_hints(ServerSpec)[name]
        if hint is bool:
            parser.add_argument(option.torch, dest=name, action="store_true", help=option.help)
            continue
        choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
        # ``int | None`` parses as an int; a Literal's choices are strings.
        kind = None if choices else next(arg for arg in (*typing.get_args(hint), hint) if arg in (int, float))
        parser.add_argument(
            option.torch,
            dest=name,
            type=option.parse or kind,
            choices=choices,
            default=_SERVE_DEFAULTS.get(name, _DEFAULTS[name]),
            help=option.help,
        )


def _options() -> dict[str, ServerOption]:
    hints = typing.get_type_hints(ServerSpec, include_extras=True)
    return {
        name: next(meta for meta in hints[name].__metadata__ if isinstance(meta, ServerOption))
        for name in ServerSpec.__struct_fields__
    }


_OPTIONS = _options()
_DEFAULTS = {field.name: field.default for field in msgspec.structs.fields(ServerSpec)}
# ``rollflow serve`` run by hand: where its default is not "the engine's own" (None).
_SERVE_DEFAULTS = {"max_batch_size": 64}
