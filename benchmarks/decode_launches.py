"""Kernels a graphed decode step launches, counted on this CPU: the family's model at its published shape on meta
tensors (no memory, no weights), one decode graph's computation run as capture records it, every Triton launch
caught by Triton's compile hook under a stand-in sm90 driver (nothing compiled, nothing run) and every torch op that
would launch a kernel on the GPU counted by a dispatch mode (views, aliases and allocations launch none).

At batch 1 the GPU idles between dependent kernels inside a graph (kimi_linear, session 15: 561 kernels a step, busy
2.04 of 3.83 ms), so the count is the lever the b=1 bars move with; this shows it without a GPU, per layer kind.
A torch op may launch more than one kernel (cuBLAS, sort), so the torch column is a lower bound.

With --prefill N it counts an eager prompt step of a fresh N-token prompt instead (fla's chunked kernels for the
recurrent layers, their autotuners on their first config): on the GPU such a step is host-bound when it launches
more kernels than its work hides (before session 26: qwen3_5_moe's 4096-token step, 1456 launches, the GPU idle half
the time).

Usage: python benchmarks/decode_launches.py [--families qwen3_5,qwen3_5_moe,mimo_v2_flash,kimi_linear] [--batch 1]
       [--rows 12] [--prefill 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_hybrid import PAGE, hf_config  # noqa: E402

# torch ops that launch no kernel: allocation, metadata, and the ops a capture records nothing for
MAX_LEN = 8192  # the context the rotary table and the decode graphs are made for
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
                       "detach", "alias", "resize_", "set_", "sym_size", "sym_stride", "sym_numel", "is_nonzero",
                       "_local_scalar_dense", "record_stream"})
# the other recipe families at the tests' tiny configs (tests/models/*_tiny.py): a checkpoint written, then read
# as an export reads it; per layer, a launch count depends on the layer's kind, not its widths
TINY = {
    "qwen3_next": lambda out: __import__("tests.models.hybrid_tiny", fromlist=["x"]).build_hybrid("qwen3_next", out),
    "nemotron_h": lambda out: __import__("tests.models.nemotron_h_tiny", fromlist=["x"]).build_nemotron_h(out),
    "qwen4_exp": lambda out: __import__("tests.models.qwen4_exp_tiny", fromlist=["x"]).build_qwen4_exp("plain", out),
    "glm5_next": lambda out: __import__("tests.models.glm5_next_tiny", fromlist=["x"]).build_glm5_next(out),
    "deepseek_v4": lambda out: __import__("tests.models.deepseek_v4_tiny", fromlist=["x"]).build_deepseek_v4(out),
    "minimax_m3": lambda out: __import__("tests.models.minimax_m3_tiny", fromlist=["x"]).build_minimax_m3(out),
    "step3p7": lambda out: __import__("tests.models.step3p7_tiny", fromlist=["x"]).build_step3p7(out),
    "muse_spark": lambda out: __import__("tests.models.muse_spark_tiny", fromlist=["x"]).build_muse_spark(out),
    "gemma4": lambda out: __import__("tests.models.gemma4_tiny", fromlist=["x"]).build_gemma4(out),
}


def meta_arch(family: str, dtype: torch.dtype = torch.bfloat16):
    """The family's architecture: gpu_hybrid's families at the published shape, from shapes alone (HF's model built
    on meta tensors, through ignition's arch module, nothing read); the others at their tests' tiny config."""
    from ignition.archs import convert
    from ignition.sources import open_source
    from ignition.sources.base import Checkpoint, LazyTensor

    if family in TINY:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return convert(open_source(TINY[family](Path(tmp) / "hf")), dtype)[0]
    cls, cfg = hf_config(family)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in cls(cfg).state_dict().items()}

    def unread():
        raise AssertionError("decode_launches reads no weight")

    lazy = {k: LazyTensor(s, "bfloat16", unread) for k, s in shapes.items()}
    ckpt = Checkpoint(config=cfg.to_dict(), tensors=lazy, tokenizer_json="{}", tokenizer_config={},
                      chat_template=None, identifier=f"random-{cfg.model_type}")
    arch, _ = convert(ckpt, dtype)
    return arch


def viewable(t: torch.Tensor, shape_of: torch.Tensor) -> bool:
    """Whether a view of `t` has the other tensor's shape (else reshape copies)."""
    try:
        t.view(shape_of.shape)
    except RuntimeError:
        return False
    return True


class Launches(TorchDispatchMode):
    """Counts, by (layer kind, kernel), the torch ops that launch a kernel (Triton launches are added by the hook)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.kinds: dict[int, str] = {}  # id(layer module) -> its kind

    def where(self) -> str:
        """The kind of the model layer whose code is running (the innermost one on the stack), else "model"."""
        frame = sys._getframe(2)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self.kinds:
                return self.kinds[id(owner)]
            frame = frame.f_back
        return "model"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # NOTE: aten.to is annotated as an alias (it returns its input when nothing changes) but copies, and
        # launches a kernel, whenever it returns a new tensor; reshape (seen whole here) copies where no view
        # of its input has the shape (a split's columns reshaped across their row stride)
        copied = args and out is not args[0] and (name == "to" or (name == "reshape" and not viewable(args[0], out)))
        if copied or (not func.is_view and name not in NO_KERNEL):
            self.counts[(self.where(), f"torch {name}")] += 1
        return out


def layer_kind(arch, layer: torch.nn.Module, index: int) -> str:
    """The layer's mixer type (the config's layer_types entry) and its feed-forward (moe / mlp / none)."""
    mixer = arch.layer_types[index] if arch.layer_types else "full_attention"
    ffn = "moe" if getattr(layer, "moe", None) is not None else ("mlp" if getattr(layer, "mlp", None) is not None
                                                               else "no-ffn")
    return f"{mixer}+{ffn}"


@contextlib.contextmanager
def _traced_model(family: str, dtype: torch.dtype = torch.bfloat16):
    """(arch, model on meta tensors, the Launches mode, layers by kind) with every Triton launch counted by the
    compile hook under a stand-in sm90 driver (nothing compiled, nothing run) and fla's autotuners on their first
    config; the rotary table made as the runner and helios.runner.aot_trace make it."""
    from triton import knobs
    from triton.runtime import driver

    from helios.kernels._triton import meta_as_gpu
    from helios.kernels.aot import _every_launch_missing, _TargetDriver
    from helios.layers.rotary import tabulate_rope
    from helios.runner.aot_trace import meta_model
    from helios.runner.input_batch import max_table_blocks
    from helios.switches import DEFAULT_SWITCHES

    arch = meta_arch(family, dtype)
    mode = Launches()

    def hook(**kwargs):
        mode.counts[(mode.where(), kwargs["fn"].name)] += 1
        return True  # no compile, no launch

    layers_by_kind: Counter = Counter()
    previous_driver, previous_hook = getattr(driver, "_active", None), knobs.runtime.jit_cache_hook
    driver.set_active(_TargetDriver(90))
    knobs.runtime.jit_cache_hook = hook
    try:
        with meta_as_gpu(9, 132), torch.inference_mode(), _every_launch_missing(), _first_configs():
            model = meta_model(arch, dtype)
            if DEFAULT_SWITCHES.rope_table:
                tabulate_rope(model, max_table_blocks(MAX_LEN, PAGE) * PAGE, dtype)
            for i, layer in enumerate(model.layers):
                mode.kinds[id(layer)] = layer_kind(arch, layer, i)
                layers_by_kind[mode.kinds[id(layer)]] += 1
            yield arch, model, mode, layers_by_kind
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


def count(family: str, batch: int) -> tuple[Counter, Counter]:
    """(launches by (where, kernel), layers by kind) of one graphed decode step of `batch` rows."""
    from helios.runner.aot_trace import _NUM_PAGES
    from helios.runner.cuda_graphs import GraphRunner, unsupported_reason
    from helios.runner.kv_cache import KVCache
    from helios.runner.model_runner import layer_caches
    from helios.runner.state_cache import StateCache

    dtype, meta = torch.bfloat16, torch.device("meta")
    with _traced_model(family, dtype) as (arch, model, mode, layers_by_kind):
        reason = unsupported_reason(model, arch, torch.device("cuda"))
        assert reason is None, f"{family}: no CUDA graphs ({reason})"
        state = StateCache(arch, batch, dtype, meta) if arch.recurrent is not None else None
        kv_cache = KVCache.from_arch(arch, _NUM_PAGES, PAGE, dtype, meta)
        graphs = GraphRunner(model, kv_cache, buckets=[batch], max_model_len=MAX_LEN, page_size=PAGE,
                             vocab_size=arch.vocab_size, num_kv_heads=arch.num_kv_heads, device=meta,
                             capture=False, state_scratch=state.scratch_slot if state is not None else None,
                             layer_caches=layer_caches(arch, kv_cache, state))
        graphs.buffers.pad_all()
        graphs._forward(batch, graphs.graph_splits(batch)[0])  # the warm-up a capture runs first (it makes
        mode.counts.clear()  # the layers' cached constants), then the computation it records
        with mode:
            graphs._forward(batch, graphs.graph_splits(batch)[0])
    return mode.counts, layers_by_kind


@contextlib.contextmanager
def _first_configs():
    """fla's Triton autotuners take their first config, unbenchmarked (nothing runs on meta tensors)."""
    from triton.runtime.autotuner import Autotuner

    def first(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        self.best_config = self.configs[0]
        return self.fn.run(*args, **kwargs, **self.configs[0].all_kwargs())

    previous = Autotuner.run
    Autotuner.run = first
    try:
        yield
    finally:
        Autotuner.run = previous


def count_prefill(family: str, num_tokens: int) -> tuple[Counter, Counter]:
    """(launches by (where, kernel), layers by kind) of one eager prompt step: a fresh `num_tokens`-token prompt, as
    the runner runs it (no graph), with fla's chunked kernels for the recurrent layers."""
    from dataclasses import replace

    from helios.engine.messages import SamplingParams, ScheduledRequest
    from helios.runner.input_batch import _META_TENSORS, RequestState, layout_batch, prepare_batch
    from helios.runner.kv_cache import KVCache
    from helios.runner.model_runner import layer_caches
    from helios.runner.state_cache import StateCache

    dtype, meta = torch.bfloat16, torch.device("meta")
    with _traced_model(family, dtype) as (arch, model, mode, layers_by_kind):
        state = StateCache(arch, 2, dtype, meta) if arch.recurrent is not None else None
        kv_cache = KVCache.from_arch(arch, num_tokens // PAGE + 8, PAGE, dtype, meta)
        caches = layer_caches(arch, kv_cache, state)
        ids = [(7 * j) % 1000 + 10 for j in range(num_tokens)]
        chunk = ScheduledRequest(req_id="p", token_ids=ids, num_computed_tokens=0,
                                 block_ids=list(range(-(-num_tokens // PAGE))), group_block_ids=[], sample=True,
                                 state_slot=0 if state is not None else -1)
        requests = {"p": RequestState("p", list(ids), SamplingParams())}
        batch = prepare_batch([chunk], requests, PAGE, "cpu", layout_batch([chunk], requests, PAGE),
                              state.scratch_slot if state is not None else None)
        on_meta = {name: getattr(batch.meta, name).to(meta) for name in _META_TENSORS
                   if getattr(batch.meta, name) is not None}
        for _ in range(2):  # the first makes the layers' cached constants, as a real first step does
            mode.counts.clear()
            with mode:
                hidden = model.forward(batch.token_ids.to(meta), replace(batch.meta, **on_meta, derived={}), caches)
                model.compute_logits(hidden[batch.logits_indices.to(meta)])
    return mode.counts, layers_by_kind


def report(family: str, batch: int, rows: int, prefill: int = 0) -> None:
    counts, layers = count_prefill(family, prefill) if prefill else count(family, batch)
    total = sum(counts.values())
    triton = sum(n for (_, k), n in counts.items() if not k.startswith("torch "))
    step = f"prefill {prefill}" if prefill else f"b={batch}"
    print(f"== {family} {step}: {total} kernels a step ({triton} Triton, {total - triton} torch ops), "
          f"{sum(layers.values())} layers: {dict(layers)}")
    by_where: dict[str, Counter] = {}
    for (where, kernel), n in counts.items():
        by_where.setdefault(where, Counter())[kernel] += n
    for where, kernels in sorted(by_where.items(), key=lambda item: -sum(item[1].values())):
        per = layers.get(where, 1)
        top = ", ".join(f"{k} {n / per:g}" for k, n in kernels.most_common(rows))
        print(f"  {where}: {sum(kernels.values()) / per:g} a {'layer' if where in layers else 'step'} ({top})")


def summary(family: str, batch: int, prefill: int = 0) -> dict:
    """{"total": kernels a step, "layers": {kind: kernels a layer of that kind}, "step": the rest}: a graphed decode
    step of `batch` rows, or with `prefill` an eager prompt step of that many tokens."""
    counts, layers = count_prefill(family, prefill) if prefill else count(family, batch)
    by_where = Counter()
    for (where, _), n in counts.items():
        by_where[where] += n
    return {"total": sum(counts.values()), "step": by_where.get("model", 0),
            "layers": {kind: by_where[kind] / n for kind, n in layers.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_5,qwen3_5_moe,mimo_v2_flash,kimi_linear")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rows", type=int, default=12, help="kernels listed per layer kind")
    parser.add_argument("--prefill", type=int, default=0, help="count an eager prompt step of this many tokens "
                        "(a fresh prompt) instead of a decode step")
    parser.add_argument("--json", action="store_true", help="one JSON line: each family's summary()")
    args = parser.parse_args()
    families = args.families.split(",")
    if args.json:
        print(json.dumps({family: summary(family, args.batch, args.prefill) for family in families}))
        return
    for family in families:
        report(family, args.batch, args.rows, args.prefill)


if __name__ == "__main__":
    main()
