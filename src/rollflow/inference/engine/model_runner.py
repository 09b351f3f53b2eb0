"""Batched forward passes of Llama-style decoders over a slot-based KV cache.

``ModelRunner`` reads the weights of a Hugging Face causal LM (Llama, Qwen2, Qwen3, Qwen3-MoE) from its submodules and
runs its own forward: one prefill of newly admitted prompts (right-padded into one batch) and decode steps
over the slots ``0..num_rows-1``. The arithmetic is the HF forward's; where it departs, it is only to cut the
number of torch calls per step (at small sizes a step costs Python and dispatch overhead, not FLOPs):

- q/k/v and gate/up projections are fused into one matmul each (``refresh_weights`` rebuilds the fused copies
  after the model's weights change in place);
- q_norm/k_norm run as one normalization over the q and k heads together, then one multiply by the per-head
  weights;
- cos/sin come from tables computed once by the model's own ``rotary_emb`` for positions 0..max_model_len-1,
  and ``rotate_half(x) * sin`` is computed as ``roll(x) * sin_signed`` (the same products, sign folded in);
- decode attention handles GQA by grouping the query heads of each kv head into the query-length dimension
  instead of repeating keys and values, and masks each row to its own length with an additive mask.

The KV cache holds keys and values of one layer in one tensor ``[max_batch_size, 2 * kv_heads, max_model_len,
head_dim]`` (keys in the first ``kv_heads`` heads), so one ``index_copy_`` per layer writes a decode step.
``extend`` is a prefill that starts after a prefix already in the slot (the engine's prefix cache).

Mixture-of-experts layers (Qwen3-MoE's sparse block) run HF's eager arithmetic: router linear, float32 softmax,
top-k, renormalized when ``norm_topk_prob``, then each selected expert's SwiGLU on its tokens, weighted and
summed. With ``record_routed_experts`` every forward also leaves the top-k expert ids of every token it ran,
per MoE layer, in ``last_routed_experts`` (what vLLM returns as ``routed_experts``, for routing replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollflow.errors import EngineError
from rollflow.inference.engine.adapter_stack import HEAD, AdapterStack

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# RoPE variants whose cos/sin depend on the sequence length; a fixed table cannot reproduce them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _norm_eps(norm: torch.nn.Module, default: float) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", default)))


def _bias(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(linear, "bias", None)


@dataclass(slots=True)
class _LayerWeights:
    """Weights of one decoder layer, fused where that saves a call."""

    input_norm: torch.Tensor
    input_norm_eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    # [q_heads + kv_heads, head_dim]: q_norm's weight per q head, then k_norm's per kv head; None without q/k norm.
    qk_norm: torch.Tensor | None
    qk_norm_eps: float
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_norm_eps: float
    # Dense MLP; None in a MoE layer.
    gate_up_weight: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor | None
    down_bias: torch.Tensor | None
    # MoE layer: router [experts, hidden], per-expert gate/up [experts, 2 * inter, hidden] and down
    # [experts, hidden, inter]; None in a dense layer.
    router_weight: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None


def _is_moe(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


class ModelRunner:
    """Owns the KV cache and runs prefill and decode forwards on the weights of an HF causal LM.

    Not thread-safe: one thread (the engine's worker) calls it, inside ``torch.inference_mode``.

    With ``record_routed_experts`` (a MoE model only), each ``prefill``/``extend``/``decode`` sets
    ``last_routed_experts``: the top-k expert ids ``[rows, tokens, moe_layers, topk]`` of every token it ran, in
    ``routed_experts_dtype`` (padding positions included; the caller keeps the real ones).

    Raises:
        EngineError: the model's architecture (``config.model_type``) or one of its features is not supported.
        ValueError: ``max_batch_size`` or ``max_model_len`` is out of range.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int,
        max_model_len: int,
        record_routed_experts: bool = False,
    ):
        config = model.config
        model_type = getattr(config, "model_type", type(model).__name__)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineError(
                f"TorchEngine does not support model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-style decoders)"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(layer_type != "full_attention" for layer_type in layer_types):
            raise EngineError(
                f"TorchEngine does not support sliding-window attention (model_type {model_type!r}, "
                f"layer_types {sorted(set(layer_types))}); use a model without sliding windows"
            )
        rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise EngineError(
                f"TorchEngine does not support rope_type {rope_type!r} (model_type {model_type!r}): its cos/sin "
                "depend on the sequence length"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output token), got {max_model_len}"
            )
        max_positions = getattr(config, "max_position_embeddings", None)
        if max_positions is not None and max_model_len > max_positions:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_positions}; "
                f"pass max_model_len <= {max_positions}"
            )

        self.model = model
        self.model_type = model_type
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        attn = model.model.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_q_heads: int = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads: int = attn.k_proj.out_features // self.head_dim
        self.scaling: float = float(attn.scaling)
        self.hidden_size: int = model.model.embed_tokens.embedding_dim
        self.vocab_size: int = model.model.embed_tokens.num_embeddings
        self.num_layers = len(model.model.layers)
        hidden_act = getattr(config, "hidden_act", "silu")
        # F.silu skips the module call; other activations use the model's own module.
        mlp = model.model.layers[0].mlp
        self._act = F.silu if hidden_act == "silu" else getattr(mlp, "act_fn", None) or mlp.experts.act_fn
        moe_blocks = [layer.mlp for layer in model.model.layers if _is_moe(layer.mlp)]
        if any(not hasattr(b.experts, "gate_up_proj") or not hasattr(b.gate, "top_k") for b in moe_blocks):
            raise EngineError(
                f"TorchEngine runs {model_type!r} MoE layers in transformers' fused-experts layout "
                "(experts.gate_up_proj, gate.top_k), which this model does not have; upgrade transformers"
            )
        self.num_moe_layers = len(moe_blocks)
        self.num_experts = moe_blocks[0].gate.num_experts if moe_blocks else 0
        self.moe_top_k: int = moe_blocks[0].gate.top_k if moe_blocks else 0
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        if record_routed_experts and not moe_blocks:
            raise EngineError(
                f"returning routed experts needs a mixture-of-experts model, but model_type {model_type!r} has "
                "no MoE layers; turn it off (inference.return_routed_experts = false, or no "
                "--enable-return-routed-experts)"
            )
        self.record_routed_experts = record_routed_experts
        # The smallest integer type that holds every expert id: routes are kept per token of every sequence.
        self.routed_experts_dtype = torch.uint8 if self.num_experts <= 256 else torch.int32
        self.last_routed_experts: torch.Tensor | None = None

        embed = model.model.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        with torch.inference_mode():
            # RoPE tables from the model's own rotary module, so cos/sin match the HF forward exactly.
            positions = torch.arange(max_model_len, device=self.device)[None]
            cos, sin = model.model.rotary_emb(embed[:1], positions)
            half = self.head_dim // 2
            sign = torch.ones(self.head_dim, device=self.device, dtype=sin.dtype)
            sign[:half] = -1
            self._cos = cos[0]  # [max_model_len, head_dim]
            self._sin_signed = sin[0] * sign
            self._kv_cache: torch.Tensor | None = None
            self._kv_flat: torch.Tensor | None = None
            self.allocate_kv_cache()
            # Flat-row offsets of (slot, k/v head) at position 0, for the decode write.
            slots = torch.arange(max_batch_size, device=self.device)[:, None]
            heads = torch.arange(2 * self.num_kv_heads, device=self.device)[None]
            self._row_offsets = (slots * 2 * self.num_kv_heads + heads) * max_model_len
            self._key_index = torch.arange(max_model_len, device=self.device)
        self._layers: list[_LayerWeights] = []
        #: Unmerged LoRA (``adapter_stack``): the stack, and each row's slot in the next forward (one slot for
        #: every row, or a ``[rows]`` tensor); set by the caller before ``prefill``/``extend``/``decode``.
        self.adapter_stack: AdapterStack | None = None
        self.adapter_rows: torch.Tensor | int = 0
        # Set while the weights are released (sleep): name -> (CPU copy or None when discarded, shape).
        self._released_weights: dict[str, tuple[torch.Tensor | None, torch.Size]] | None = None
        self.refresh_weights()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds (0 while released)."""
        if self._kv_cache is None:
            return 0
        return self._kv_cache.numel() * self._kv_cache.element_size()

    def allocate_kv_cache(self) -> None:
        """(Re)allocate the KV cache, zeroed, if it was released."""
        if self._kv_cache is not None:
            return
        self._kv_cache = torch.zeros(
            self.num_layers,
            self.max_batch_size,
            2 * self.num_kv_heads,
            self.max_model_len,
            self.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self._kv_flat = self._kv_cache.view(self.num_layers, -1, self.head_dim)

    def release_kv_cache(self) -> None:
        """Free the KV cache (sleep); no forward may run until ``allocate_kv_cache``."""
        self._kv_cache = self._kv_flat = None

    @property
    def weights_released(self) -> bool:
        return self._released_weights is not None

    @torch.no_grad()
    def release_weights(self, *, keep: bool) -> None:
        """Free the weights' memory (sleep): the fused copies, and every parameter's device storage.

        ``keep``: parameters on an accelerator are copied to CPU memory first and come back as they were
        (vLLM's sleep level 1); parameters already in CPU memory stay where they are. Otherwise they are
        discarded (level 2) and come back zeroed: a weight load must overwrite them before the next forward.
        Buffers (rotary tables) stay.
        """
        if self._released_weights is not None:
            return
        released: dict[str, tuple[torch.Tensor | None, torch.Size]] = {}
        with torch.inference_mode(False):
            for name, param in self.model.named_parameters():  # tied weights once
                if keep and param.device.type == "cpu":
                    continue
                backup = param.data.to("cpu") if keep else None
                released[name] = (backup, param.shape)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._released_weights = released
        self._layers = []
        self._embed = self._final_norm = self._lm_head = self._lm_head_bias = None

    @torch.no_grad()
    def restore_weights(self) -> None:
        """Bring released weights back (kept ones as they were, discarded ones zeroed) and rebuild the fused
        copies."""
        released, self._released_weights = self._released_weights, None
        if released is None:
            return
        with torch.inference_mode(False):
            for name, param in self.model.named_parameters():
                if name not in released:
                    continue
                backup, shape = released[name]
                if backup is not None:
                    param.data = backup.to(param.device)
                else:
                    param.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.refresh_weights()

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuild the fused weights from the model's parameters (call after changing them)."""
        model = self.model.model
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            biases = [_bias(p) for p in projections]
            qkv_bias = None
            if any(b is not None for b in biases):
                qkv_bias = torch.cat(
                    [
                        b if b is not None else p.weight.new_zeros(p.out_features)
                        for b, p in zip(biases, projections, strict=True)
                    ]
                )
            qk_norm = None
            qk_norm_eps = 0.0
            if getattr(attn, "q_norm", None) is not None:
                qk_norm = torch.cat(
                    [
                        attn.q_norm.weight.expand(self.num_q_heads, self.head_dim),
                        attn.k_norm.weight.expand(self.num_kv_heads, self.head_dim),
                    ]
                )
                qk_norm_eps = _norm_eps(attn.q_norm, 1e-6)
            gate_up_weight = gate_up_bias = down_weight = down_bias = None
            router_weight = experts_gate_up = experts_down = None
            if _is_moe(mlp):
                router_weight = mlp.gate.weight
                experts_gate_up, experts_down = mlp.experts.gate_up_proj, mlp.experts.down_proj
            else:
                gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                if _bias(mlp.gate_proj) is not None:
                    gate_up_bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
                down_weight, down_bias = mlp.down_proj.weight, _bias(mlp.down_proj)
            layers.append(
                _LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    input_norm_eps=_norm_eps(layer.input_layernorm, 1e-6),
                    qkv_weight=torch.cat([p.weight for p in projections]),
                    qkv_bias=qkv_bias,
                    qk_norm=qk_norm,
                    qk_norm_eps=qk_norm_eps,
                    o_weight=attn.o_proj.weight,
                    o_bias=_bias(attn.o_proj),
                    post_norm=layer.post_attention_layernorm.weight,
                    post_norm_eps=_norm_eps(layer.post_attention_layernorm, 1e-6),
                    gate_up_weight=gate_up_weight,
                    gate_up_bias=gate_up_bias,
                    down_weight=down_weight,
                    down_bias=down_bias,
                    router_weight=router_weight,
                    experts_gate_up=experts_gate_up,
                    experts_down=experts_down,
                )
            )
        self._layers = layers
        self._embed = model.embed_tokens.weight
        self._final_norm = model.norm.weight
        self._final_norm_eps = _norm_eps(model.norm, 1e-6)
        self._lm_head = self.model.lm_head.weight
        self._lm_head_bias = _bias(self.model.lm_head)

    def copy_prefixes(self, sources: list[int], targets: list[int], lengths: list[int]) -> None:
        """Copy the keys and values of the first ``lengths[i]`` positions of slot ``sources[i]`` into slot
        ``targets[i]``, in every layer (sequences sharing a prompt)."""
        by_length: dict[int, tuple[list[int], list[int]]] = {}
        for source, target, length in zip(sources, targets, lengths, strict=True):
            if length > 0:
                pair = by_length.setdefault(length, ([], []))
                pair[0].append(source)
                pair[1].append(target)
        cache = self._kv_cache
        for length, (source_slots, target_slots) in by_length.items():
            source_index = torch.tensor(source_slots, device=self.device)
            target_index = torch.tensor(target_slots, device=self.device)
            cache[:, target_index, :, :length] = cache[:, source_index, :, :length]

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts (one per slot) from position 0, fill their KV cache, return last-token logits [n, vocab]."""
        n = len(prompts)
        lengths = [len(prompt) for prompt in prompts]
        seq_len = max(lengths)
        padded = [prompt + [0] * (seq_len - len(prompt)) for prompt in prompts]
        input_ids = torch.tensor(padded, device=self.device)
        slot_index = torch.tensor(slots, device=self.device)
        kv_heads = self.num_kv_heads

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Right padding: causal attention keeps every real token away from the padding after it.
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            self._kv_cache[layer, slot_index, :kv_heads, :seq_len] = k
            self._kv_cache[layer, slot_index, kv_heads:, :seq_len] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
            return out.transpose(1, 2).reshape(n, seq_len, -1)

        cos = self._cos[:seq_len][None, :, None]
        sin = self._sin_signed[:seq_len][None, :, None]
        hidden = self._layers_forward(F.embedding(input_ids, self._embed), cos, sin, attend)
        last = torch.tensor(lengths, device=self.device) - 1
        return self._logits(hidden[torch.arange(n, device=self.device), last])

    def extend(self, slots: list[int], prompts: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Prefill whose rows resume from a cached prefix: slot ``slots[i]`` already holds the keys and values
        of ``prompts[i][:starts[i]]`` (``0 < starts[i] < len(prompts[i])``), so only the rest is run, at
        positions ``starts[i]..len-1``. Returns last-token logits [n, vocab], as ``prefill`` does.
        """
        n = len(prompts)
        new_lens = [len(prompt) - start for prompt, start in zip(prompts, starts, strict=True)]
        seq_len, kv_len = max(new_lens), max(len(prompt) for prompt in prompts)
        padded = [
            prompt[start:] + [0] * (seq_len - new_len)
            for prompt, start, new_len in zip(prompts, starts, new_lens, strict=True)
        ]
        input_ids = torch.tensor(padded, device=self.device)
        offsets = torch.arange(seq_len, device=self.device)[None]
        # Padding queries get a clamped (valid) position; their keys and values are never written.
        positions = (torch.tensor(starts, device=self.device)[:, None] + offsets).clamp_(
            max=self.max_model_len - 1
        )
        valid = offsets < torch.tensor(new_lens, device=self.device)[:, None]
        slot_index = torch.tensor(slots, device=self.device)
        write_slots = slot_index[:, None].expand(n, seq_len)[valid]
        write_positions = positions[valid]
        # Query j of row i sees cache positions 0..starts[i]+j: its cached prefix, then causal over new tokens.
        mask = torch.zeros(n, 1, seq_len, kv_len, device=self.device, dtype=self.dtype).masked_fill_(
            (self._key_index[:kv_len][None, None] > positions[:, :, None])[:, None], float("-inf")
        )
        kv_heads = self.num_kv_heads

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer_cache = self._kv_cache[layer]
            layer_cache[write_slots, :, write_positions] = torch.cat((k, v), dim=2)[valid]
            cache = layer_cache[slot_index, :, :kv_len]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                cache[:, :kv_heads],
                cache[:, kv_heads:],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=True,
            )
            return out.transpose(1, 2).reshape(n, seq_len, -1)

        cos = self._cos[positions][:, :, None]
        sin = self._sin_signed[positions][:, :, None]
        hidden = self._layers_forward(F.embedding(input_ids, self._embed), cos, sin, attend)
        last = torch.tensor(new_lens, device=self.device) - 1
        return self._logits(hidden[torch.arange(n, device=self.device), last])

    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step over slots ``0..len(token_ids)-1``: slot i feeds ``token_ids[i]`` at ``positions[i]``.

        Each row attends to its own cache positions ``0..positions[i]``. Rows of empty slots pass position -1:
        they compute garbage that the caller ignores and write nothing, so a free slot keeps the keys and values
        the prefix cache labelled it with. Returns logits [n, vocab].
        """
        n = len(token_ids)
        kv_len = max(positions) + 1
        input_ids = torch.tensor(token_ids, device=self.device)[:, None]
        position = torch.tensor(positions, device=self.device)
        empty_rows = min(positions) < 0
        if empty_rows:
            written = position >= 0
            position = position.clamp(min=0)
            write_rows = (self._row_offsets[:n] + position[:, None])[written].flatten()
        else:
            write_rows = (self._row_offsets[:n] + position[:, None]).flatten()
        # Additive mask (0 / -inf), built once per step and shared by every layer.
        mask = torch.zeros(n, 1, 1, kv_len, device=self.device, dtype=self.dtype).masked_fill_(
            (self._key_index[:kv_len] > position[:, None])[:, None, None], float("-inf")
        )
        kv_heads, group = self.num_kv_heads, self.num_q_heads // self.num_kv_heads

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = torch.cat((k, v), dim=2)
            if empty_rows:
                kv = kv[written]
            self._kv_flat[layer].index_copy_(0, write_rows, kv.reshape(-1, self.head_dim))
            cache = self._kv_cache[layer, :n, :, :kv_len]
            # GQA without repeat_kv: the query heads of one kv head act as that head's query positions.
            q = q.reshape(n, kv_heads, group, self.head_dim)
            out = F.scaled_dot_product_attention(
                q, cache[:, :kv_heads], cache[:, kv_heads:], attn_mask=mask, scale=self.scaling
            )
            return out.reshape(n, 1, -1)

        cos = self._cos[position][:, None, None]
        sin = self._sin_signed[position][:, None, None]
        hidden = self._layers_forward(F.embedding(input_ids, self._embed), cos, sin, attend)
        return self._logits(hidden[:, 0])

    def _layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        n, seq_len, _ = x.shape
        q_heads, kv_heads, head_dim = self.num_q_heads, self.num_kv_heads, self.head_dim
        qk_heads = q_heads + kv_heads
        hidden_shape = (self.hidden_size,)
        act = self._act
        stack, rows = self.adapter_stack, self.adapter_rows
        routes: list[torch.Tensor] | None = [] if self.record_routed_experts else None
        for index, w in enumerate(self._layers):
            h = F.rms_norm(x, hidden_shape, w.input_norm, w.input_norm_eps)
            qkv = F.linear(h, w.qkv_weight, w.qkv_bias)
            if stack is not None:
                qkv = stack.add(qkv, h, (index, "qkv"), rows)
            qkv = qkv.view(n, seq_len, qk_heads + kv_heads, head_dim)
            qk = qkv[:, :, :qk_heads]
            if w.qk_norm is not None:
                qk = F.rms_norm(qk, (head_dim,), None, w.qk_norm_eps) * w.qk_norm
            qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
            attn = attend(index, qk[:, :, :q_heads], qk[:, :, q_heads:], qkv[:, :, qk_heads:])
            out = F.linear(attn, w.o_weight, w.o_bias)
            x = x + (out if stack is None else stack.add(out, attn, (index, "o"), rows))
            h = F.rms_norm(x, hidden_shape, w.post_norm, w.post_norm_eps)
            if w.router_weight is not None:
                x = x + self._moe(h.view(n * seq_len, -1), w, routes).view_as(x)
                continue
            gate_up = F.linear(h, w.gate_up_weight, w.gate_up_bias)
            if stack is None:
                gate, up = gate_up.chunk(2, dim=-1)
                x = x + F.linear(act(gate) * up, w.down_weight, w.down_bias)
                continue
            gate, up = stack.add(gate_up, h, (index, "gate_up"), rows).chunk(2, dim=-1)
            inner = act(gate) * up
            x = x + stack.add(F.linear(inner, w.down_weight, w.down_bias), inner, (index, "down"), rows)
        if routes is not None:
            self.last_routed_experts = torch.stack(routes, dim=1).view(n, seq_len, len(routes), -1)
        return x

    def _moe(self, h: torch.Tensor, w: _LayerWeights, routes: list[torch.Tensor] | None) -> torch.Tensor:
        """Qwen3-MoE's sparse block on tokens ``h`` [tokens, hidden], in the HF forward's arithmetic."""
        probs = F.softmax(F.linear(h, w.router_weight), dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.moe_top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights /= top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(h.dtype)
        if routes is not None:
            routes.append(top_experts.to(self.routed_experts_dtype))
        out = torch.zeros_like(h)
        # One pass per expert that some token chose, over just those tokens (a decode step hits few experts).
        # A token chooses an expert at most once, so each (token, choice) pair is added exactly once.
        for expert in top_experts.unique().tolist():
            token_index, choice = torch.where(top_experts == expert)
            gate, up = F.linear(h[token_index], w.experts_gate_up[expert]).chunk(2, dim=-1)
            expert_out = F.linear(self._act(gate) * up, w.experts_down[expert])
            out.index_add_(0, token_index, expert_out * top_weights[token_index, choice, None])
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = F.rms_norm(hidden, (self.hidden_size,), self._final_norm, self._final_norm_eps)
        logits = F.linear(hidden, self._lm_head, self._lm_head_bias)
        if self.adapter_stack is None:
            return logits
        return self.adapter_stack.add(logits, hidden, (-1, HEAD), self.adapter_rows)
