"""The neutral checkpoint every source reader produces.

A Checkpoint is HF-shaped whatever the source: `config` is an HF config.json dict, tensors carry HF
parameter names (e.g. "model.layers.0.self_attn.q_proj.weight") in HF orientation, with any
source-specific layout (llama.cpp's Q/K row permutation, GGUF's reversed dims) already undone and
quantized types dequantized to float32. ignition/archs maps these names to the core's runtime layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class LazyTensor:
    """A tensor read on demand, so a large checkpoint is never fully resident."""

    shape: tuple[int, ...]
    dtype: str  # source dtype label, e.g. "bfloat16", "Q4_1"
    load: Callable[[], torch.Tensor]


@dataclass
class Checkpoint:
    config: dict  # HF config.json contents (model_type, hidden_size, ...)
    tensors: dict[str, LazyTensor]  # HF names -> lazy tensors
    tokenizer_json: str  # HF tokenizers JSON text
    tokenizer_config: dict  # HF tokenizer_config.json subset: bos/eos/pad/unk tokens, add_bos_token, ...
    chat_template: str | None  # Jinja source, None when the checkpoint has none
    generation_config: dict = field(default_factory=dict)
    identifier: str = ""  # checkpoint id: hub id, directory name or GGUF name
    source_files: list[Path] = field(default_factory=list)  # files whose bytes define the source

    def iter_tensors(self) -> Iterator[tuple[str, LazyTensor]]:
        for name in sorted(self.tensors):
            yield name, self.tensors[name]
