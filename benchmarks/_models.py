"""Model shapes the benchmarks share (not a benchmark itself: it prints nothing)."""

from __future__ import annotations

# A random-init Qwen3 of ~100M parameters: 32k x 768 tied embeddings (24.6M) + 12 layers of 6.3M. Large enough
# that a weight update or a LoRA merge costs what a real model's would in proportion, small enough for a CPU.
QWEN3_100M = {
    "vocab_size": 32_000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
