"""The kernels a core's captured decode steps launch, found by running them: the family's model, its KV and state
caches and the graph buffers built on `meta` tensors (no memory, no weights), and each decode bucket's graphed
computation (every split variant) run once while helios.kernels.aot's compile hook intercepts each Triton launch.
A launch on meta tensors carries the GPU's specialization (dtypes, constexprs, the 16-divisibility of sizes and
strides, the 16-byte alignment of each view's offset), so the kernels compiled from it at export and loaded from it
at start are the ones capture asks for: hybrid, MoE and the newer attention families need no hand-kept list.
The llama layers' launches are listed by hand instead (helios.kernels.aot_shapes, with every switch's variants);
their families are not traced. Prefill steps are not traced: fla's chunked kernels autotune on the device.
Imports torch, helios.models, helios.layers, helios.runner (caches, graphs) and helios.kernels._triton.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from helios.kernels._triton import meta_as_gpu
from helios.layers.attention import select_attention_backend
from helios.layers.rotary import tabulate_rope
from helios.models import bind_tensors, float32_kept, model_class, use_layer_kernels
from helios.runner.cuda_graphs import GraphRunner, unsupported_reason
from helios.runner.input_batch import max_table_blocks
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import layer_caches
from helios.runner.state_cache import StateCache
from helios.switches import DEFAULT_SWITCHES, Switches

# families whose runtime launches helios.kernels.aot_shapes.run_launchers lists (the llama decoder's layers)
HAND_LISTED = frozenset({"llama", "qwen2", "qwen3", "gemma3"})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_META = torch.device("meta")
# pages of the meta KV cache: a page count enters no kernel's specialization (the [2, pages, ...] tensor's stride
# over K / V is a multiple of the page size, 16)
_NUM_PAGES = 16


def decode_tracer(manifest, switches: Switches = DEFAULT_SWITCHES, major: int = 9,
                  num_sms: int = 132) -> Callable[[], bool] | None:
    """A call that runs every decode graph of the core (trace_decode), or None for a family listed by hand.
    major, num_sms: the compute capability and multiprocessors of the GPU the meta tensors stand for (the kernel
    target's, or the device's at start: decode split counts follow the multiprocessors)."""
    if manifest.arch.family in HAND_LISTED:
        return None

    def trace() -> bool:
        # NOTE: the kernels are an optimization (helios compiles on first use): a step the trace cannot run on meta
        # tensors (a host sync in a layer's decode path) costs the kernels after it, never the export or the start
        try:
            return trace_decode(manifest, switches, major, num_sms)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"decode graphs of {manifest.arch.family} not traced for precompiled kernels: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
            return False

    return trace


def meta_model(arch, dtype: torch.dtype, switches: Switches = DEFAULT_SWITCHES) -> torch.nn.Module:
    """The family's model on the Triton backend with every weight a meta tensor of `dtype`, as the runner binds
    them on CUDA: the norm multipliers a module keeps in float32 (Architecture.float32_norms, `keep_float32`) in
    float32, as helios.runner.model_runner.move_tensors and bind_tensors leave them (the kernels specialize on the
    weight's dtype: a change there must be mirrored here)."""
    backend = select_attention_backend("triton", _META, switches)
    model = model_class(arch.family)(arch, backend, _META, dtype=dtype, switches=switches, norms_folded=False)
    use_layer_kernels(model, getattr(backend, "fuses_layers", False))  # as helios.models.build_model

    kept = float32_kept(model)
    tensors = {name: torch.empty(p.shape, dtype=torch.float32 if name in kept else dtype, device=_META)
               for name, p in model.named_parameters()}
    bind_tensors(model, tensors, _META, dtype)
    return model.eval()


def trace_decode(manifest, switches: Switches = DEFAULT_SWITCHES, major: int = 9, num_sms: int = 132) -> bool:
    """Run each decode bucket's graphed computation of the core's plan on meta tensors, as ModelRunner builds
    its graphs (no window page group); returns False, running nothing, where the runner would not capture.
    NOTE: only inside a compile hook that skips the launches (helios.kernels.aot): a launch on meta fails."""
    arch, plan = manifest.arch, manifest.graph_plan
    dtype = _DTYPES[manifest.dtype]
    max_model_len = manifest.limits.context_length
    with meta_as_gpu(major, num_sms), torch.inference_mode():
        model = meta_model(arch, dtype, switches)
        if unsupported_reason(model, arch, torch.device("cuda")) is not None:
            return False
        if switches.rope_table:
            tabulate_rope(model, max_table_blocks(max_model_len, plan.page_size) * plan.page_size, dtype)
        buckets = list(plan.decode_buckets)
        state = StateCache(arch, max(buckets), dtype, _META) if arch.recurrent is not None else None
        kv_cache = KVCache.from_arch(arch, _NUM_PAGES, plan.page_size, dtype, _META)
        graphs = GraphRunner(model, kv_cache, buckets=buckets, max_model_len=max_model_len, page_size=plan.page_size,
                             vocab_size=arch.vocab_size, num_kv_heads=arch.num_kv_heads, device=_META, capture=False,
                             state_scratch=state.scratch_slot if state is not None else None,
                             layer_caches=layer_caches(arch, kv_cache, state))
        for bucket in graphs.buckets:
            graphs.run_variants(bucket)
    return True
