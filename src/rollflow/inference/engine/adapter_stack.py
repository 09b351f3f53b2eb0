"""Several versions of one LoRA adapter served unmerged: each row of a forward picks its own version.

The merged path (``adapters.py``) serves one adapter version at a time: its weights are ``W_base + B @ A``. The
unmerged path keeps the base weights as they are and adds ``(x @ A_s^T) @ B_s^T`` to each adapted projection's
output, where ``s`` is the row's slot; slot 0 holds no adapter (the base). So sequences started on different
policy versions can decode in one batch, each on its own adapter: what a request started on version k needs
to finish on k while the trainer pushes k + 1.

The engine's forward fuses q/k/v and gate/up into one matmul each (``model_runner``); the adapter follows:
a site's ``A`` is the modules' ``A`` stacked along the rank, its ``B`` block-diagonal, so one pair of matmuls
serves the fused projection. Tensors are the wire view (``<module>.lora_A.weight`` ``[r, in]``,
``<module>.lora_B.weight`` ``[out, r]``, B already scaled; ``rollflow.train.lora``).
"""

from __future__ import annotations

import torch

from rollflow.errors import EngineError
from rollflow.weights.delivery import ADAPTER_SUFFIXES

_A, _B = ADAPTER_SUFFIXES
#: Fused sites of one decoder layer and the modules each is made of, in the fused weight's row order.
_LAYER_SITES = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
HEAD = "lm_head"


def _sites(model: torch.nn.Module) -> dict[tuple[int, str], list[tuple[str, int, int]]]:
    """``(layer, site) -> [(module name, out_features, in_features)]``, and ``(-1, "lm_head")``."""
    sites: dict[tuple[int, str], list[tuple[str, int, int]]] = {}
    for index, layer in enumerate(model.model.layers):
        for site, modules in _LAYER_SITES.items():
            entries = []
            for module in modules:
                linear = layer.get_submodule(module) if _has(layer, module) else None
                if linear is not None:
                    name = f"model.layers.{index}.{module}"
                    entries.append((name, linear.out_features, linear.in_features))
            if entries:
                sites[(index, site)] = entries
    head = model.lm_head
    sites[(-1, HEAD)] = [(HEAD, head.out_features, head.in_features)]
    return sites


def _has(layer: torch.nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


class AdapterStack:
    """``capacity`` adapter slots (slot 0: no adapter) over a model's base weights, applied per row.

    Not thread-safe: the engine's worker thread owns it, as it owns the runner.
    """

    def __init__(self, model: torch.nn.Module, capacity: int):
        if capacity < 2:
            raise ValueError(
                f"an adapter stack needs capacity >= 2 (the base and one adapter), got {capacity}"
            )
        self.capacity = capacity
        self._sites = _sites(model)
        embed = model.model.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        #: ``(layer, site) -> (A [capacity, R, in], B [capacity, out, R])``, for sites some adapter holds.
        self.tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, slot: int, adapter: dict[str, torch.Tensor]) -> None:
        """Write one adapter version (wire-view names) into ``slot`` (1..capacity-1), replacing what it held.

        Raises:
            EngineError: a name no site of the model has, a half without the other, shapes that do not fit,
                or ranks that differ from the adapter the stack already holds.
        """
        if not 1 <= slot < self.capacity:
            raise ValueError(f"adapter slot must be in 1..{self.capacity - 1}, got {slot}")
        known = {name for entries in self._sites.values() for name, _, _ in entries}
        unknown = sorted({n.removesuffix(_A).removesuffix(_B) for n in adapter} - known)
        if unknown:
            raise EngineError(f"the adapter names modules the engine cannot adapt: {', '.join(unknown[:5])}")
        built = {}
        for key, entries in self._sites.items():
            pairs = [(adapter.get(name + _A), adapter.get(name + _B), out, inp) for name, out, inp in entries]
            if all(a is None and b is None for a, b, _, _ in pairs):
                continue
            built[key] = self._fuse(entries, pairs)
        for key, (a, b) in built.items():
            if key not in self.tensors:
                shape_a, shape_b = (self.capacity, *a.shape), (self.capacity, *b.shape)
                zeros = dict(device=self.device, dtype=self.dtype)
                self.tensors[key] = (torch.zeros(shape_a, **zeros), torch.zeros(shape_b, **zeros))
            stack_a, stack_b = self.tensors[key]
            if stack_a.shape[1:] != a.shape or stack_b.shape[1:] != b.shape:
                raise EngineError(
                    f"adapter site {key}: A {tuple(a.shape)} / B {tuple(b.shape)} differ from the versions "
                    f"held ({tuple(stack_a.shape[1:])} / {tuple(stack_b.shape[1:])}): one rank per run"
                )
        for key, (stack_a, stack_b) in self.tensors.items():
            a, b = built.get(key, (None, None))
            stack_a[slot] = 0 if a is None else a
            stack_b[slot] = 0 if b is None else b

    def _fuse(self, entries, pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """One site's ``A`` (ranks stacked) and block-diagonal ``B`` from its modules' halves."""
        blocks = []  # (A, B, first output row of the module in the fused weight)
        row = 0
        for (name, out, inp), (a, b, _, _) in zip(entries, pairs, strict=True):
            if (a is None) != (b is None):
                raise EngineError(f"{name}: lora_A and lora_B come together")
            if a is not None:
                fits = a.ndim == 2 and b.ndim == 2 and a.shape[1] == inp and b.shape[0] == out
                if not fits or a.shape[0] != b.shape[1]:
                    raise EngineError(
                        f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its weight "
                        f"[{out}, {inp}]"
                    )
                blocks.append((a, b, row))
            row += out
        rank = sum(a.shape[0] for a, _, _ in blocks)
        fused_b = torch.zeros(row, rank, dtype=torch.float32)
        column = 0
        for a, b, first in blocks:
            fused_b[first : first + b.shape[0], column : column + a.shape[0]] = b.float()
            column += a.shape[0]
        fused_a = torch.cat([a.float() for a, _, _ in blocks])
        return fused_a.to(self.device, self.dtype), fused_b.to(self.device, self.dtype)

    def add(
        self, out: torch.Tensor, x: torch.Tensor, key: tuple[int, str], rows: torch.Tensor | int
    ) -> torch.Tensor:
        """``out`` plus the adapter of each row's slot applied to ``x`` (``[n, t, in]`` or ``[n, in]``);
        ``rows`` is one slot for every row, or a ``[n]`` tensor of slots."""
        entry = self.tensors.get(key)
        if entry is None or (isinstance(rows, int) and rows == 0):
            return out
        stack_a, stack_b = entry
        if isinstance(rows, int):
            return out + torch.nn.functional.linear(
                torch.nn.functional.linear(x, stack_a[rows]), stack_b[rows]
            )
        a, b = stack_a[rows], stack_b[rows]  # [n, R, in], [n, out, R]
        flat = x.dim() == 2
        xs = x[:, None] if flat else x
        delta = torch.matmul(torch.matmul(xs, a.transpose(1, 2)), b.transpose(1, 2))
        return out + (delta[:, 0] if flat else delta)
