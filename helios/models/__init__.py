"""Model registry: family -> forward-only module, plus binding a core's tensors without copies.

A model is built with its parameters on the `meta` device, then `bind_tensors` points every parameter
at the loader's (mmap-backed) tensor. Family modules are imported inside the factory, so one family's
code is loaded only when a core of that family is served. Never imports the engine, runner or ignition.
"""

from __future__ import annotations

import functools
import importlib
from typing import Protocol

import torch
from torch import nn

from helios.core.layout import MTP_PREFIX
from helios.core.manifest import Architecture
from helios.layers.attention import AttentionMetadata, select_attention_backend
from helios.layers.activation import GatedMLP
from helios.layers.norm import RMSNorm
from helios.layers.norm_free import pdl_launches
from helios.switches import DEFAULT_SWITCHES, Switches

# family -> "module:Class"
_FAMILIES = {
    "llama": "helios.models.llama:LlamaForCausalLM",
    "qwen2": "helios.models.llama:LlamaForCausalLM",
    "qwen3": "helios.models.llama:LlamaForCausalLM",
    "qwen3_moe": "helios.models.qwen3_moe:Qwen3MoeForCausalLM",
    "gemma3": "helios.models.gemma3:Gemma3ForCausalLM",
    "qwen3_5": "helios.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5_moe": "helios.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_next": "helios.models.qwen3_5:Qwen3_5ForCausalLM",
    "nemotron_h": "helios.models.nemotron_h:NemotronHForCausalLM",
    "qwen4_exp": "helios.models.qwen4_exp:Qwen4ExpForCausalLM",
    "kimi_linear": "helios.models.kimi_linear:KimiLinearForCausalLM",
    "glm5_next": "helios.models.glm5_next:Glm5NextForCausalLM",
    "mimo_v2_flash": "helios.models.mimo_v2_flash:MiMoV2FlashForCausalLM",
    "gemma4": "helios.models.gemma4:Gemma4ForCausalLM",
    "minimax_m3": "helios.models.minimax_m3:MiniMaxM3ForCausalLM",
    "step3p7": "helios.models.step3p7:Step3p7ForCausalLM",
    "muse_spark": "helios.models.muse_spark:MuseSparkForCausalLM",
    "deepseek_v4": "helios.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def split_draft_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the main model's tensors, the MTP draft modules' mtp.* ones), both as mapped (no copy)."""
    draft = {name: t for name, t in tensors.items() if name.startswith(MTP_PREFIX)}
    return {name: t for name, t in tensors.items() if name not in draft}, draft


class CausalLM(Protocol):
    """What the runner calls; every family module implements it."""

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, Nkv, D]
    ) -> torch.Tensor:  # [T, H] final-normed hidden states
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] model dtype
        ...


def build_model(
    arch: Architecture,
    tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    *,
    switches: Switches = DEFAULT_SWITCHES,
    norms_folded: bool = False,
    tp=None,
    replace: dict[str, nn.Module] | None = None,
) -> CausalLM:
    """Build the family's module on meta, bind `tensors` (cast/moved only if dtype/device differ). The model picks
    its forward path here, once: from the backend, device, dtype and `switches`; norms_folded says the runner's
    load step folded the norm weights into `tensors` (helios.runner.norm_folding); tp: this rank's
    helios.layers.parallel.TensorGroup, `tensors` and `arch` then its shard's (helios.runner.parallel). replace:
    {module name: module} swapped in before binding, their tensors then absent from `tensors` (helios.runner.
    host_embedding: a table kept in host memory, read through a device row cache)."""
    cls = model_class(arch.family)
    backend = select_attention_backend(attention_backend, device, switches)
    model_dtype = dtype or tensors["embed.weight"].dtype  # the activations' (the path's GEMV rule reads it)
    parallel = {} if tp is None else {"tp": tp}  # only the families that shard take it
    model = cls(arch, backend, device, dtype=model_dtype, switches=switches, norms_folded=norms_folded, **parallel)
    use_layer_kernels(model, getattr(backend, "fuses_layers", False))
    if switches.pdl is True:
        scope_pdl(model)
    for name, module in (replace or {}).items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, module)
    bind_tensors(model, tensors, device, dtype)
    return model.eval()


def scope_pdl(model: nn.Module) -> None:
    """The pdl switch on (HELIOS_PDL=1): the model's forward and compute_logits run inside pdl_launches, so every
    one-row Triton launch of a batch-1 step takes PDL (each waits for the kernel before it in its first lines), in
    every family, captured graphs included. A family that scopes its own steps (llama's norm-free layers) keeps
    its finer rule when the switch is unset."""
    for name in ("forward", "compute_logits"):
        method = getattr(model, name)

        @functools.wraps(method)
        def in_scope(*args, _method=method, **kwargs):
            with pdl_launches(True):
                return _method(*args, **kwargs)

        setattr(model, name, in_scope)


def use_layer_kernels(model: nn.Module, on: bool) -> None:
    """On the Triton backend (on), every RMSNorm and gated MLP of the model, whoever built it, takes its Triton
    launch: the norm's one kernel for torch's five, the MLP's activation inside its down GEMV (batch 1) or one
    act-and-mul kernel, not two torch ops (a decode graph's kernel count is what a batch-1 GPU step pays for:
    benchmarks/decode_launches.py). Same values (each module's docstring). Off leaves the modules as built."""
    if not on:
        return
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = True
        elif isinstance(module, GatedMLP):
            # its constructor's rule; the kernel knows silu and gelu_tanh, with `gated`'s clamps and alpha
            module.fused = module.act in ("silu", "gelu_tanh")


def model_class(family: str) -> type:
    """The family's module class (imported here, on first use)."""
    if family not in _FAMILIES:
        raise ValueError(f"no model for family {family!r}; known: {sorted(_FAMILIES)}")
    module, cls = _FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), cls)


def folds_norm_weights(arch: Architecture) -> bool:
    """Whether the family's layers take norm weights folded into qkv / gate_up (helios.runner.norm_folding)."""
    rule = getattr(model_class(arch.family), "folds_norm_weights", None)
    return bool(rule is not None and rule(arch))


def float32_kept(model: nn.Module) -> set[str]:
    """The parameters bind_tensors leaves in float32 in a 16-bit model: those of modules that keep their weight in
    float32 (`keep_float32`, set where Architecture.float32_norms says the core holds a norm's multiplier so) or
    bind it so (`bind_float32`: the MoE routers)."""
    return {name for name, _ in model.named_parameters() if _binds_float32(model.get_submodule(name.rpartition(".")[0]))}


def _binds_float32(module: nn.Module) -> bool:
    return getattr(module, "keep_float32", False) or getattr(module, "bind_float32", False)


def bind_tensors(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> None:
    """Point each meta parameter at tensors[name]; names are the core layout's names exactly.

    Strict both ways: a missing tensor, an unused tensor or a shape mismatch raises ValueError. The MTP draft
    modules' tensors (MTP_PREFIX) are the one exception: no model binds them yet, so they are left unbound.
    """
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"core lacks tensor {missing[0]} (and {len(missing) - 1} more)")
    unused = sorted(set(tensors) - set(expected) - set(split_draft_tensors(tensors)[1]))
    if unused:
        raise ValueError(f"core tensor {unused[0]} has no place in the {type(model).__name__} model")
    for name, param in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"tensor {name}: shape {tuple(t.shape)}, the architecture wants {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        # a float32 norm multiplier of a 16-bit core stays float32 where its module asks (Architecture.float32_norms);
        # a router's table is bound in float32 whatever the core holds (helios.layers.moe._Router)
        module = model.get_submodule(owner)
        keep = getattr(module, "bind_float32", False) or (t.dtype == torch.float32 and _binds_float32(module))
        # NOTE: .to() returns the same tensor (no copy) when device and dtype already match.
        t = t.to(device=device, dtype=torch.float32 if keep else dtype or t.dtype)
        module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
