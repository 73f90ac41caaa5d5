"""Architecture registry: an HF-shaped Checkpoint -> (Architecture, lazy runtime tensors in helios/core/layout.py).

One module per family builds the plan; this module picks it by model_type (imported inside the factory),
validates the Architecture, and owns the size arithmetic (num_params, decode_weight_bytes).
Family modules share `Weights`, the consumption-tracking view of the checkpoint's tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import msgspec
import torch

from helios.core.manifest import Architecture
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor

Producer = Callable[[], torch.Tensor]
Plan = dict[str, Producer]  # runtime tensor name -> producer

# model_type -> module whose `build(ckpt, dtype) -> (Architecture, Plan)` handles it
_REGISTRY = {
    "llama": "ignition.archs.llama",
    "qwen2": "ignition.archs.llama",
    "qwen3": "ignition.archs.llama",
    "qwen3_moe": "ignition.archs.qwen3_moe",
    "gemma3_text": "ignition.archs.gemma3",
    "gemma3": "ignition.archs.gemma3",  # multimodal wrapper: its text_config, vision weights ignored
    "qwen3_5_text": "ignition.archs.qwen3_5",
    "qwen3_5": "ignition.archs.qwen3_5",  # multimodal wrapper: its text_config, vision and MTP weights ignored
    "qwen3_5_moe_text": "ignition.archs.qwen3_5",
    "qwen3_5_moe": "ignition.archs.qwen3_5",  # multimodal wrapper, as qwen3_5
    "qwen3_next": "ignition.archs.qwen3_5",
    "nemotron_h": "ignition.archs.nemotron_h",
    "kimi_linear": "ignition.archs.kimi_linear",
    "qwen4_exp_text": "ignition.archs.qwen4_exp", "qwen4_exp": "ignition.archs.qwen4_exp",  # wrapper: its text_config
    "glm5_next": "ignition.archs.glm5_next", "glm5_next_text": "ignition.archs.glm5_next",  # wrapper: text_config
    "mimo_v2_flash": "ignition.archs.mimo_v2_flash", "mimo_v2": "ignition.archs.mimo_v2_flash",  # V2.5/V2.6: fused qkv
    "gemma4_text": "ignition.archs.gemma4", "gemma4": "ignition.archs.gemma4",  # wrapper: its text_config
    "minimax_m3_vl": "ignition.archs.minimax_m3", "minimax_m3_vl_text": "ignition.archs.minimax_m3",  # wrapper: text
    "step3p7": "ignition.archs.step3p7", "step3p5": "ignition.archs.step3p7",  # wrapper: text_config; flat text
    "muse_spark": "ignition.archs.muse_spark", "muse_spark_text": "ignition.archs.muse_spark",  # wrapper: text_config
    "deepseek_v4": "ignition.archs.deepseek_v4",
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_REGISTRY))
# family -> its module, for a family no model_type spells (the size arithmetic looks for its layer_params there)
_FAMILY_MODULES = {"minimax_m3": "ignition.archs.minimax_m3"}


def convert(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[Architecture, Iterator[tuple[str, Producer]]]:
    """The Architecture and the runtime tensors sorted by name, each produced on demand in `dtype`.

    Raises ExportError for an unsupported model_type, a missing, misshapen or unexpected tensor, or a
    config feature the runtime does not implement. Nothing is loaded until a producer is called.
    """
    model_type = ckpt.config.get("model_type")
    module_name = _REGISTRY.get(model_type)
    if module_name is None:
        raise ExportError(
            f"unsupported architecture '{model_type}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    arch, plan = importlib.import_module(module_name).build(ckpt, dtype)
    try:  # Struct construction skips Meta bounds; a round trip applies them
        arch = msgspec.convert(msgspec.to_builtins(arch), Architecture)
    except msgspec.ValidationError as e:
        raise ExportError(f"{ckpt.identifier}: config gives an invalid architecture: {e}") from None
    return arch, iter(sorted(plan.items()))


class Weights:
    """The checkpoint's tensors seen from the text model: shape-checked lookups that record what was used.

    `prefix` is the text decoder's (e.g. "model."); `check_all_used` turns any tensor no rule consumed into an
    ExportError, so a checkpoint with weights the runtime would silently drop (biases, extra experts) fails.
    """

    def __init__(self, ckpt: Checkpoint, prefixes: tuple[str, ...], ignore: tuple[str, ...] = ()):
        self.tensors = ckpt.tensors
        self.identifier = ckpt.identifier
        self.ignore = ignore
        self.used: set[str] = set()
        found = [p for p in prefixes if p + "embed_tokens.weight" in self.tensors]
        if not found:
            looked = ", ".join(p + "embed_tokens.weight" for p in prefixes)
            raise ExportError(f"{self.identifier}: no embedding tensor (looked for {looked})")
        self.prefix = found[0]

    def has(self, name: str, root: bool = False) -> bool:
        return (name if root else self.prefix + name) in self.tensors

    def take(self, name: str, shape: tuple[int, ...], root: bool = False) -> LazyTensor:
        """The tensor `prefix + name` (or `name` with root=True), checked against `shape`."""
        full = name if root else self.prefix + name
        t = self.tensors.get(full)
        if t is None:
            raise ExportError(f"{self.identifier}: checkpoint lacks tensor '{full}'")
        if tuple(t.shape) != tuple(shape):
            raise ExportError(
                f"{self.identifier}: tensor '{full}' has shape {list(t.shape)}, the config implies {list(shape)}"
            )
        self.used.add(full)
        return t

    def skip(self, name: str, root: bool = False) -> None:
        """Mark a tensor the runtime does not need (e.g. a stored lm_head under tied embeddings) as handled."""
        self.used.add(name if root else self.prefix + name)

    def check_all_used(self) -> None:
        left = sorted(
            n
            for n in self.tensors
            if n not in self.used and not n.startswith(self.ignore) and not n.endswith("rotary_emb.inv_freq")
        )
        if left:
            shown = ", ".join(left[:5]) + (f", … ({len(left)} in all)" if len(left) > 5 else "")
            raise ExportError(f"{self.identifier}: tensors the runtime has no place for: {shown}")


def _attn_params(arch: Architecture) -> int:
    """Parameters of an attention layer outside its MLP: norms, qkv (+bias, + gate rows), qk norms, o."""
    h, d = arch.hidden_size, arch.head_dim
    q_rows = arch.num_heads * d * (2 if arch.attn_output_gate else 1)
    qkv_rows = q_rows + 2 * arch.num_kv_heads * d
    n = 2 * h + qkv_rows * h + h * arch.num_heads * d  # two norms, qkv, o
    n += qkv_rows if arch.attention_bias else 0
    n += 2 * d if arch.qk_norm else 0
    n += 2 * h if arch.sandwich_norms else 0
    return n


def _recurrent_params(arch: Architecture) -> int:
    """Parameters of a recurrent (gated-delta) layer outside its MLP: norms, in_proj, conv, dt_bias, A_log,
    gated norm, out."""
    h, r = arch.hidden_size, arch.recurrent
    if r.kind != "gated_delta":  # NOTE: each recurrent kind lays out its own weights; count each when it lands
        raise NotImplementedError(f"parameter count of recurrent kind {r.kind!r}")
    value = r.num_heads * r.value_head_dim
    in_rows = r.conv_dim + value + 2 * r.num_heads  # q, k, v, z, b, a
    return 2 * h + in_rows * h + r.conv_dim * r.conv_kernel + 2 * r.num_heads + r.value_head_dim + h * value


def _mixer_params(arch: Architecture, layer_index: int) -> int:
    if arch.layer_types and arch.layer_types[layer_index] == "linear":
        return _recurrent_params(arch)
    return _attn_params(arch)


def _mlp_params(arch: Architecture, layer_index: int, experts_read: int | None) -> int:
    """MLP parameters of one layer; an MoE layer counts `experts_read` experts (None: all of them)."""
    h = arch.hidden_size
    moe = arch.moe
    if moe is None or layer_index in moe.dense_layers:
        return 3 * h * arch.intermediate_size
    experts = moe.num_experts if experts_read is None else experts_read
    n = moe.num_experts * h + experts * 3 * h * moe.moe_intermediate_size  # router + experts
    if moe.shared_expert_intermediate_size:  # every token reads the shared expert and its gate
        n += 3 * h * moe.shared_expert_intermediate_size + h
    return n


def _layer_params(arch: Architecture, layer_index: int, experts_read: int | None) -> int:
    """One layer's parameters: its family module's own count (`layer_params`, these arguments) where it has one."""
    module = _REGISTRY.get(arch.family) or _FAMILY_MODULES.get(arch.family, __name__)
    own = getattr(importlib.import_module(module), "layer_params", None)
    if own is not None:
        return own(arch, layer_index, experts_read)
    return _mixer_params(arch, layer_index) + _mlp_params(arch, layer_index, experts_read)


def _extra_params(arch: Architecture, decode: bool) -> int:
    """The family module's parameters outside its layers beyond embedding, final norm and lm_head (`extra_params`,
    gemma4's per-layer embeddings; one step reads one table row when `decode`), 0 where it has none."""
    module = _REGISTRY.get(arch.family) or _FAMILY_MODULES.get(arch.family, __name__)
    own = getattr(importlib.import_module(module), "extra_params", None)
    return own(arch, decode) if own is not None else 0


def num_params(arch: Architecture) -> int:
    """Parameters of the runtime tensors (a tied lm_head counted once, all experts)."""
    h, v = arch.hidden_size, arch.vocab_size
    n = v * h + h + (0 if arch.tie_word_embeddings else v * h) + _extra_params(arch, False)
    for i in range(arch.num_layers):
        n += _layer_params(arch, i, None)
    return n


def decode_weight_bytes(arch: Architecture, dtype: torch.dtype | str) -> int:
    """Weight bytes one decode step reads for one request: the physical floor of batch-1 decode.

    The embedding gather reads one row; the lm_head matmul reads vocab x hidden once (tied or not);
    an MoE layer reads its router, num_experts_per_tok experts and its shared expert; a recurrent layer reads all
    its weights (its per-request state is not a weight).
    """
    h, v = arch.hidden_size, arch.vocab_size
    top_k = arch.moe.num_experts_per_tok if arch.moe is not None else None
    n = h + v * h + h + _extra_params(arch, True)  # embedding row, lm_head, final norm, the family's extras
    for i in range(arch.num_layers):
        n += _layer_params(arch, i, top_k)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return n * torch.empty((), dtype=dtype).element_size()
