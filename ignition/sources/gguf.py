"""GGUF file -> the neutral Checkpoint: HF names, HF orientation, float32 on load.

Owns the tensor side: the memory-mapped reader (gguf.GGUFReader, GGUFFile), the up-front type check, GGUF -> HF
parameter names, dequantization (the gguf package's own dequantizers, never hand-written ones) and the
undoing of llama.cpp's layout changes (llama's Q/K row permutation, Gemma's norm weights stored as 1 + w),
each exactly as transformers' GGUF loading does it. Config and tokenizer come from gguf_config and
gguf_tokenizer. Must not import transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.sources.gguf_config import build_config, check_arch
from ignition.sources.gguf_tokenizer import build_tokenizer

Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
# LazyTensor.dtype labels: torch names for plain floats (as the safetensors reader), ggml names for blocks
_FLOAT_LABELS = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per block; llama.cpp's ffn_norm is its pre-feedforward one.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MOE_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_gate_inp": "mlp.gate"}
# stacked [num_experts, rows, cols] tensors, split into the per-expert names hub checkpoints use
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TABLES = {"gemma3": _GEMMA3_BLOCK_NAMES, "qwen3moe": _MOE_BLOCK_NAMES}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")

Transform = Callable[[torch.Tensor], torch.Tensor]


class GGUFFile(GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memory map (the same pages, the same fields and tensors).

    NOTE: the reader slices its map once or more per metadata value, and numpy.memmap's slicing runs Python
    (__getitem__, __array_finalize__) each time: for a vocabulary of 150k-260k tokens that was three quarters of
    the open (Qwen2.5-Coder-0.5B 10.8 -> 3.6 s, Gemma 3 270M 12.5 -> 3.7 s on a 2-core CPU)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._data = value.view(np.ndarray)


def open_gguf(path: Path) -> Checkpoint:
    """Read a GGUF file's metadata and tensor table; tensors are dequantized only when loaded.

    Checkpoint.identifier is the file stem (e.g. "SmolLM2-135M-Instruct.Q4_1"): general.name is free text
    that often misdescribes the file ("Qwen2.5 Coder 0.5B Instruct AWQ" for a Q4_K_M export).
    """
    path = Path(path)
    where = path.name
    try:
        reader = GGUFFile(path, "r")
    except Exception as e:  # a truncated or foreign file fails anywhere in the parser
        raise ExportError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = check_arch(meta.get("general.architecture"), where)
    # NOTE: checked before anything is built, so an unloadable file fails at open time, never mid-export
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ExportError(f"{where}: tensor {t.name} has unsupported GGUF type {t.tensor_type.name}")

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # llama3-style rope scaling lives in this tensor, not in metadata; dropping it would change the model
        raise ExportError(f"{where}: tensor rope_freqs.weight (llama3 rope scaling) is not supported")
    config = build_config(arch, meta, names, where)
    tensors: dict[str, LazyTensor] = {}
    for t in reader.tensors:
        for hf_name, lazy in _map_tensor(t, arch, config, where):
            tensors[hf_name] = lazy
    tokenizer, tokenizer_config = build_tokenizer(arch, meta, where)
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tokenizer_config,
        chat_template=tokenizer_config["chat_template"],
        identifier=path.stem,
        source_files=[path],
    )


def _map_tensor(t: ReaderTensor, arch: str, config: dict[str, Any], where: str) -> list[tuple[str, LazyTensor]]:
    """One GGUF tensor -> its HF name(s) and lazy tensor(s); experts fan out into one tensor each."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest-moving dim first
    if m := _BLOCK_RE.fullmatch(t.name):
        layer, leaf, kind = m.groups()
        prefix = f"model.layers.{layer}."
        if arch == "qwen3moe" and leaf in _EXPERT_NAMES:
            if len(shape) != 3:
                raise ExportError(f"{where}: tensor {t.name} has shape {shape}, expected [experts, rows, cols]")
            name = f"{prefix}mlp.experts.{{}}.{_EXPERT_NAMES[leaf]}.{kind}"
            return [(name.format(e), _lazy(t, shape[1:], None, expert=e)) for e in range(shape[0])]
        table = _BLOCK_TABLES.get(arch, _BLOCK_NAMES)
        hf = table.get(leaf)
        hf_name = f"{prefix}{hf}.{kind}" if hf else None
    elif m := _GLOBAL_RE.fullmatch(t.name):
        leaf, kind = m.groups()
        hf = _GLOBAL_NAMES.get(leaf)
        hf_name = f"{hf}.{kind}" if hf else None
    else:
        hf_name = leaf = None
    if hf_name is None:
        raise ExportError(f"{where}: tensor {t.name} has no HF name for GGUF architecture {arch}")
    return [(hf_name, _lazy(t, shape, _transform(arch, leaf, config)))]


def _transform(arch: str, leaf: str, config: dict[str, Any]) -> Transform | None:
    """What undoes llama.cpp's conversion for this tensor, if anything (as transformers' TensorProcessors)."""
    if arch == "llama" and leaf in ("attn_q", "attn_k"):
        # convert_hf_to_gguf permutes Q/K rows (weight and bias) for its rotary layout
        heads = config["num_attention_heads"] if leaf == "attn_q" else config["num_key_value_heads"]
        return lambda w: _unpermute_rows(w, heads)
    if arch == "gemma3" and leaf.endswith("norm"):
        # llama.cpp stores Gemma's RMSNorm weight as 1 + w; HF computes x * (1 + w) from w itself.
        # In float32, as transformers subtracts, so the values agree bit for bit.
        return lambda w: w - 1.0
    return None


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute(): per head, the GGUF interleaves the two rotary halves row by row
    ([half, 2]); HF keeps them as two blocks ([2, half]), the layout its rotate_half expects."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _lazy(t: ReaderTensor, shape: tuple[int, ...], transform: Transform | None, expert: int | None = None
          ) -> LazyTensor:
    qtype = t.tensor_type
    data = t.data if expert is None else t.data[expert]  # each expert's rows are whole blocks

    def load() -> torch.Tensor:
        values = dequantize(data, qtype)
        if np.may_share_memory(values, data):  # F32 comes back as a view of the read-only mmap
            values = values.copy()
        tensor = torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape)
        return transform(tensor) if transform is not None else tensor

    return LazyTensor(shape=shape, dtype=_FLOAT_LABELS.get(qtype, qtype.name), load=load)
