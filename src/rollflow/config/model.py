"""``[model]``: which model is trained and how its chats are rendered."""

from __future__ import annotations

from rollflow.config.base import Section


class ModelConfig(Section):
    path: str = "rollflow:tiny"
    """``rollflow:tiny`` (built locally), a local Hugging Face model directory, or a name in the local HF cache."""
    renderer: str = "auto"
    """Chat renderer (a ``renderers`` config name such as ``qwen3``, or ``default`` for the tokenizer's chat
    template). ``auto``: qwen3 for ``rollflow:tiny``, otherwise the renderer renderers registers for the model's
    Hugging Face name (taken from the HF cache layout or ``config.json``'s ``_name_or_path``, not the snapshot
    path), else ``default`` with a warning. A run writes the resolved name into its ``config.json``."""
    enable_thinking: bool = False
    """Whether the generation prompt opens a thinking block (renderers that support it)."""
