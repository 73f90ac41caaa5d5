"""The model runner: executes one engine plan (SchedulerOutput) on the model over the paged KV cache.

One step: drop finished requests, register new ones, flatten every scheduled request (prefill chunks
and decodes mixed) into one token batch, run the model once, compute logits only for the rows that
are used, sample, and extract logprobs. Plain data in and out (helios.engine.messages); tensors never
cross the boundary. Sampling and logprob extraction live in runner/sampler.py and runner/logprobs.py.
On CUDA, decode-only steps that fit a bucket replay a CUDA graph (runner/cuda_graphs.py), and the next
decode step is enqueued before this one's ids are read back (runner/decode_overlap.py); a mixed step replays its
decode rows' graph beside its prompt rows, which a few short chunks take through a prompt graph
(runner/prompt_graphs.py, captured lazily like the decode buckets); construction
loads precompiled kernels, moves the weights, sizes the KV pool from free memory and captures (with
lazy_capture, only the smallest and largest buckets: `capture_pending` takes the rest one at a time, between
steps, and a step whose bucket is pending captures it first), and records how long each took in `startup`.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from helios.core.manifest import Architecture, GraphPlan, KernelTarget
from helios.engine.engine_core import RequestExecutionError
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import (
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    RequestResult,
    RunnerStats,
    SamplingParams,
    SchedulerOutput,
    ScheduledRequest,
)
from helios.layers.attention import attention_backend_name
from helios.layers.linear import pack_cpu_linears
from helios.layers.rotary import tabulate_rope
from helios.models import model_class
from helios.models import build_model, split_draft_tensors
from helios.runner import early_upload
from helios.runner.cpu_threads import DecodeThreads, same_bits_across_threads
from helios.runner.decode_overlap import DecodeOverlap, speculable
from helios.runner.input_batch import (
    BatchLayout,
    RequestRows,
    RequestState,
    layout_batch,
    max_table_blocks,
    prepare_batch,
)
from helios.runner.disk_cache import DiskKVStore
from helios.runner.host_cache import HostKVStore
from helios.runner.host_embedding import HostEmbeddings, build_host_embeddings, choose_host_tables
from helios.runner.kv_cache import KVCache
from helios.runner.state_cache import StateCache
from helios.runner.logprobs import logprobs_for, prompt_logprobs_for
from helios.runner.norm_folding import fold_norm_weights, foldable, should_fold
from helios.runner.sampler import SamplerState, draw_logits, sample, sample_device
from helios.switches import DEFAULT_SWITCHES, Switches

if TYPE_CHECKING:  # imported where graphs are built, as before
    from helios.runner.cuda_graphs import GraphRunner


DEFAULT_DECODE_BUCKETS = [1, 2, 4, 8] + list(range(16, 257, 16))  # when no graph plan is given
GRAPH_RESERVE_BYTES = 1 << 30  # graph pool, cuBLAS workspaces, allocator slack
SPLIT_MIN_DECODE_ROWS = 8  # a mixed step with fewer decode rows runs as one eager forward (see _split_mixed)


@dataclass
class StartupTimes:
    """Where construction spent its time (seconds), for `helios serve` to print."""

    kernels_s: float = 0.0  # precompiled kernels installed and preloaded (beside the weights upload)
    kernels_wait_s: float = 0.0  # of kernels_s, what was left after the weights were up (on the critical path)
    load_s: float = 0.0  # weights moved to the device and bound
    kv_alloc_s: float = 0.0  # KV pool sized and allocated
    capture_s: float = 0.0  # CUDA graphs captured during construction (includes each bucket's warm-up run)
    num_pages: int = 0
    num_graphs: int = 0  # captured during construction
    num_pending: int = 0  # decode buckets left for ModelRunner.capture_pending (lazy_capture)
    kernels: str = ""  # what happened to the core's precompiled kernels
    kernels_jit: int = 0  # kernels compiled (or fetched from Triton's cache) during capture
    graphs: str = ""  # why graphs are off, when they are
    prompt_graphs: str = ""  # why small prompt steps run eagerly (runner/prompt_graphs.py), when they do
    weights: str = "as bound"  # the load step's weight rewrite: "norms folded" (helios.runner.norm_folding)
    num_draft_tensors: int = 0  # the core's MTP draft modules' tensors (Architecture.mtp): mapped, not bound
    path: str = ""  # the forward path the model picked (helios.models.llama: eager, fused, norm_free)
    fla_seeded: int = 0  # fla autotuner choices put back from this device's table (helios.kernels.fla_tuning)
    early_upload: str = ""  # the upload helios.compose started before torch's import, when it ran

    def summary(self) -> str:
        total = self.kernels_wait_s + self.load_s + self.kv_alloc_s + self.capture_s
        graphs = f"{self.num_graphs} graphs" if self.num_graphs else f"no graphs: {self.graphs}"
        if self.num_pending:
            graphs += f", {self.num_pending} buckets pending"
        parts = [
            f"start-up {total:.2f} s: load {self.load_s:.2f} s",
            f"kernels {self.kernels_s:.2f} s beside it, {self.kernels_wait_s:.2f} s after "
            f"({self.kernels or 'none'}; {self.kernels_jit} compiled at capture)",
            f"KV {self.kv_alloc_s:.2f} s ({self.num_pages} pages)",
            f"capture {self.capture_s:.2f} s ({graphs})",
            f"weights {self.weights}, {self.path or 'one'} forward path",
        ]
        if self.early_upload:
            parts.append(f"weights uploaded beside torch's import ({self.early_upload})")
        if self.prompt_graphs:
            parts.append(f"prompt steps eager ({self.prompt_graphs})")
        if self.num_draft_tensors:
            parts.append(f"{self.num_draft_tensors} MTP draft tensors mapped, not bound")
        if self.fla_seeded:
            parts.append(f"{self.fla_seeded} fla kernel choices from this device's table")
        return ", ".join(parts)


def activation_reserve_bytes(arch: Architecture, num_tokens: int, dtype: torch.dtype, max_logit_rows: int) -> int:
    """Peak activation bytes of one eager step of num_tokens (one layer live at a time), plus float32 and
    model-dtype logits for max_logit_rows, plus the graph/workspace reserve."""
    width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    ffn = arch.moe.moe_intermediate_size * arch.moe.num_experts_per_tok if arch.moe else arch.intermediate_size
    per_token = (4 * arch.hidden_size + 2 * width + 3 * ffn) * dtype.itemsize
    logits = max_logit_rows * arch.vocab_size * (4 + dtype.itemsize)
    return 2 * num_tokens * per_token + logits + GRAPH_RESERVE_BYTES


def pages_from_free_memory(
    arch: Architecture, page_size: int, dtype: torch.dtype, device: torch.device, fraction: float, reserve: int,
    window_pages: int = 0,
) -> int:
    """KV pages that fit in `fraction` of the device's free memory (measured now, after the weights) less
    `reserve` bytes for activations and graphs; with a window group, its window_pages pages of the window layers
    first and group 0's pages (the other layers) from the rest."""
    torch.cuda.empty_cache()  # cached-but-free blocks (e.g. from dtype casts) count as free
    free, _ = torch.cuda.mem_get_info(device)
    window = KVCache.window_layers(arch) if window_pages else []
    rest = [i for i in arch.kv_layers if i not in window]
    window_bytes = KVCache.bytes_per_page(arch, page_size, dtype, layers=window)
    page_bytes = KVCache.bytes_per_page(arch, page_size, dtype, layers=rest)
    if arch.compressed is not None and window_pages:  # deepseek_v4: every layer's raw rows in the window group
        window_bytes, page_bytes = KVCache.compressed_bytes_per_page(arch, page_size, dtype)
    budget = int(free * fraction) - reserve - window_pages * window_bytes
    num_pages = budget // page_bytes
    if num_pages < 1:
        raise RuntimeError(
            f"no room for a KV cache: {free / 2**30:.1f} GiB free after the weights, reserve {reserve / 2**30:.1f} GiB"
        )
    return int(num_pages)


def move_tensors(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 float32_norms: bool = False, pinned: bool = False, early=None) -> dict[str, torch.Tensor]:
    """Copy each (mmap-backed) host tensor to the device, then cast there: no converted host copy. float32_norms
    (Architecture.float32_norms): a 16-bit core's float32 tensors stay float32 (its norm multipliers, kept so on
    purpose by ignition; bind_tensors casts any its module does not keep).

    NOTE: with `pinned` (the pinned_upload switch) the bytes go through a few pinned staging buffers on CUDA
    (runner/upload.py), at the host link's speed rather than the driver's pageable copy; else one copy per tensor
    (upload.move_each). Casting first would materialize a converted host copy; a tensor to be cast is allocated on
    the device only when its bytes arrive, so the peak stays near the tensors in flight.
    early: the process's finished early upload (helios.runner.early_upload.take), whose device bytes become the
    tensors it holds (upload.adopt_early); the others go as above.
    """
    from helios.runner.upload import adopt_early, move_each, upload_tensors

    keep = float32_norms and any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors.values())
    casts = {name: dtype for name, t in tensors.items()
             if not (t.dtype == dtype or (keep and t.dtype == torch.float32))}
    adopted = adopt_early(early, tensors, torch.device(device), casts) if early is not None else {}
    rest = {name: t for name, t in tensors.items() if name not in adopted}
    out = upload_tensors(rest, device, casts) if pinned else move_each(rest, torch.device(device), casts)
    out.update(adopted)
    out = {name: out[name] for name in tensors}
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return out


def limit_host_threads(switches: Switches) -> None:
    """A GPU server's torch intra-op pool at one thread, unless the host_threads switch keeps it.

    NOTE: the engine's host-side tensors are small (a step's inputs); the pool's workers only spun beside them, on
    cores the HTTP processes need: on the H100 at 64 streams (one-pass steps) served / engine went from 0.86 to 1.00
    and the GPU's busy share from 34% to 54% with one thread (benchmarks/RESULTS.md, session 23)."""
    if not switches.host_threads:
        torch.set_num_threads(1)


def resolve_device(name: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"; explicit names pass through."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def layer_caches(arch: Architecture, kv_cache: KVCache, state_cache: StateCache | None) -> list:
    """What a model's forward takes per layer: the KV tensor of an attention layer, the (conv, recurrent) state of a
    linear one, None for an ffn layer (a feed-forward block: nothing kept)."""
    if state_cache is None and "ffn" not in arch.layer_types:
        return kv_cache.layer_caches  # the KV tensors, or (KV, index keys) pairs (minimax_m3)
    kv = iter(kv_cache.layer_caches)
    states = state_cache.layers if state_cache is not None else {}
    attention = set(arch.attention_layers)
    return [states[i] if i in states else next(kv) if i in attention else None for i in range(arch.num_layers)]


def _kernels_jit() -> int:
    from helios.kernels.aot import kernels_jit_total

    return kernels_jit_total()


class _KernelLoad:
    """helios.kernels.aot.load_kernels on a thread of its own; join() gives its summary and duration, or raises
    what it raised."""

    def __init__(self, core_path: Path, kernel_targets: list[KernelTarget], device: torch.device, manifest=None,
                 switches: Switches = DEFAULT_SWITCHES):
        self._summary, self._error, self._seconds = "", None, 0.0
        self._thread = threading.Thread(target=self._run, args=(core_path, kernel_targets, device, manifest, switches),
                                        name="helios-kernel-load", daemon=True)
        self._thread.start()

    def _run(self, core_path: Path, kernel_targets: list[KernelTarget], device: torch.device, manifest,
             switches: Switches) -> None:
        from helios.kernels.aot import load_kernels, runtime_cache_root
        from helios.runner.aot_trace import decode_tracer

        t0 = time.perf_counter()
        try:
            if manifest is None and kernel_targets:
                from helios.runner.aot_compile import read_manifest

                manifest = read_manifest(core_path)
            with torch.cuda.device(device):
                # the kernels this process launches follow its switches (helios.kernels.aot_shapes.runtime_shape);
                # a hybrid or MoE family's decode graphs are traced on meta tensors (helios.runner.aot_trace)
                trace = None
                if kernel_targets:
                    props = torch.cuda.get_device_properties(device)
                    trace = decode_tracer(manifest, switches, props.major, props.multi_processor_count)
                self._summary = load_kernels(
                    core_path, kernel_targets, device, manifest, gemv=switches.gemv,
                    fused_decode=switches.fused_decode, defer_norms=switches.defer_norms, pdl=switches.pdl,
                    cache_root=runtime_cache_root(switches.kernel_cache), trace=trace,
                ).summary()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join on the constructing thread
            self._error = exc
        self._seconds = time.perf_counter() - t0

    def join(self) -> tuple[str, float]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._summary, self._seconds


class ModelRunner:
    """Owns the model, the KV cache, the decode graphs (CUDA) and the per-request state of live requests."""

    def __init__(
        self,
        arch: Architecture,
        tensors: dict[str, torch.Tensor],
        num_pages: int | None,
        page_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        *,
        graph_plan: GraphPlan | None = None,
        cuda_graphs: bool = True,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        gpu_memory_fraction: float = 0.9,
        core_path: Path | str | None = None,
        kernel_targets: list[KernelTarget] = (),
        decode_overlap: bool | None = None,
        host_cache_pages: int = 0,
        host_disk_dir: Path | str | None = None,
        switches: Switches | None = None,
        fold_norms: bool | None = None,
        manifest=None,
        lazy_capture: bool = False,
        num_state_slots: int = 0,
        host_state_records: int = 0,
        host_state_disk_dir: Path | str | None = None,
        window_pages: int = 0,
        tp=None,
        host_embeddings: str = "off",
        host_embedding_rows: int = 0,
    ):
        """num_pages=None sizes the pool from free GPU memory (CUDA only). cuda_graphs is ignored off CUDA.
        core_path + kernel_targets: the core's kernels/<target>/ dirs (see ModelRunner.from_core).
        decode_overlap: speculate the next graphed decode step (runner/decode_overlap.py); None means on
        CUDA (where graphs exist), True also on the CPU once a test attaches a GraphRunner(capture=False);
        the decode_overlap switch off turns it off whatever the argument. host_cache_pages: records of the prefix
        cache's host DRAM tier (runner/host_cache.py), 0 for none; host_disk_dir: the directory of its disk records
        (runner/disk_cache.py; use record_dir()), None for none. switches: the process's execution switches
        (helios.switches; None: the declared defaults, as if no HELIOS_* variable were set), read once at start
        by the caller and handed to the model, its layers and the kernel load. fold_norms: the norm-folding load
        step (runner/norm_folding.py); None: its GPU rule, True: wherever the family allows (tests run the
        norm-free layers in the Triton interpreter), False: never. manifest: the core's, for the kernel load (read
        from core_path when None). lazy_capture: capture only the smallest and largest decode buckets here and
        leave the rest to `capture_pending` between steps; a step whose bucket is still pending captures it first.
        num_state_slots: a hybrid model's recurrent-state rows (the engine's SchedulerConfig.num_state_slots; at
        least 1, for forward_logits, whatever is asked), allocated before the KV pool is sized from free memory.
        host_state_records: host DRAM records of checkpoint states (the engine's SchedulerConfig.host_state_records),
        0 for none; host_state_disk_dir: their disk records' directory, None for none. window_pages: the sliding-window
        layers' own page group (the engine's SchedulerConfig.window_pages, helios/engine/kv_groups.py): their KV
        tensors hold that many pages and their tables arrive as ScheduledRequest.group_block_ids (no host tiers yet);
        0: every layer holds num_pages, one table per request. tp: this rank's helios.layers.parallel.TensorGroup
        under tensor parallelism, `arch` and `tensors` then its shard's (helios.runner.parallel: a worker rank runs
        execute_shard); no CUDA graphs or decode overlap then (a worker rank mirrors the eager forwards only).
        host_embeddings: auto|on|off, which of the family's row tables (host_tables: PLE) stay in host memory behind a
        device row cache of host_embedding_rows rows each (0: runner/host_embedding.py's rule); none under tp."""
        self.switches = switches = switches if switches is not None else DEFAULT_SWITCHES
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = dtype or tensors["embed.weight"].dtype
        self.page_size = page_size
        self.max_model_len = max_model_len or arch.max_position_embeddings
        self.startup = StartupTimes()
        is_cuda = self.device.type == "cuda"

        # the MTP draft modules stay mapped on the host for the speculative-decoding issue: nothing binds them yet
        tensors, self.draft_tensors = split_draft_tensors(tensors)
        self.startup.num_draft_tensors = len(self.draft_tensors)
        t0 = time.perf_counter()
        kernel_load = None
        if is_cuda and core_path is not None:
            # before anything compiles: Triton must see the installed cache from the first kernel on. The load
            # (host-compiler launcher stubs, one tiny launch per kernel) runs beside the weights upload below,
            # which compiles nothing: a copy engine's work against a CPU's
            kernel_load = _KernelLoad(Path(core_path), list(kernel_targets), self.device, manifest, switches)
        self.tp = tp
        tensors = self._keep_host_tables(tensors, host_embeddings, host_embedding_rows, graph_plan,
                                         max_num_batched_tokens)
        # the weights a GPU server started uploading before torch's import (helios.compose), when it did (freed
        # unused off CUDA and under tensor parallelism)
        t_early = time.perf_counter()
        early = early_upload.take(core_path if is_cuda and tp is None else None, self.device.index or 0)
        if is_cuda:
            if early is not None:
                self.startup.early_upload = (f"{early.mode}, {early.num_bytes / 1e9:.2f} GB in {early.seconds:.2f} s, "
                                             f"{time.perf_counter() - t_early:.2f} s waited")
            tensors = move_tensors(tensors, self.device, self.dtype, arch.float32_norms, switches.pinned_upload,
                                   early)
        t1 = time.perf_counter()
        if kernel_load is not None:
            self.startup.kernels, self.startup.kernels_s = kernel_load.join()
        t1, weights_s = time.perf_counter(), t1 - t0
        # the load step's weight rewrite, before the model is built on the result (runner/norm_folding.py)
        fused = attention_backend_name(attention_backend, self.device) == "triton"
        if fold_norms is None:
            fold_norms = should_fold(arch, tensors, self.device, self.dtype, fused, switches)
        elif fold_norms:
            fold_norms = fused and foldable(arch, tensors)
        if fold_norms:
            # NOTE: on CUDA the moved tensors are this dict's alone: each replaced one is freed as the fold goes;
            # elsewhere the caller's (mmap-backed) dict is left as it was
            tensors = tensors if is_cuda else dict(tensors)
            fold_norm_weights(arch, tensors)
            self.startup.weights = "norms folded into qkv / gate_up"
        self.model = build_model(arch, tensors, self.device, self.dtype, attention_backend, switches=switches,
                                 norms_folded=fold_norms, tp=tp,
                                 replace=self.host_embeddings.modules() if self.host_embeddings else None)
        self.startup.path = getattr(self.model, "path", "")
        del tensors
        if is_cuda and arch.recurrent is not None:  # fla's chunked prefill: its tuned choices, not a first-prompt tune
            from helios.kernels.fla_tuning import seed_for_device

            self.startup.fla_seeded = seed_for_device(torch.cuda.get_device_name(self.device))
        if is_cuda and switches.rope_table:
            # every position a step can address: the graphs' block tables hold max_blocks pages (the speculative
            # next step stays inside a request's pages)
            tabulate_rope(self.model, max_table_blocks(self.max_model_len, page_size) * page_size, self.dtype)
        if self.device.type == "cpu" and getattr(self.model, "packs_cpu_linears", False):
            pack_cpu_linears(self.model)  # 16-bit projections in oneDNN's layout, once (float32 ones stay plain)
        t2 = time.perf_counter()
        self.state_cache = (StateCache(arch, max(1, num_state_slots), self.dtype, self.device)
                            if arch.recurrent is not None else None)
        if num_pages is None:
            if not is_cuda:
                raise ValueError("num_pages is required off CUDA (the pool is sized from free GPU memory)")
            tokens = max_num_batched_tokens or (graph_plan.prefill_chunk_size if graph_plan else 2048)
            buckets = graph_plan.decode_buckets if graph_plan else DEFAULT_DECODE_BUCKETS
            reserve = activation_reserve_bytes(arch, tokens, self.dtype, max(buckets))
            num_pages = pages_from_free_memory(arch, page_size, self.dtype, self.device, gpu_memory_fraction, reserve,
                                               window_pages)
            if tp is not None:  # one set of pages for the scheduler: every rank holds the fewest any has room for
                num_pages = tp.min_over_ranks(num_pages, self.device)
        # the window group's layers (helios/engine/kv_groups.py): their window keys their tables in the metadata
        self.window = arch.sliding_window if window_pages else None
        self.window_pages = window_pages
        if window_pages and (not KVCache.window_layers(arch) or host_cache_pages):
            raise ValueError("window_pages needs full and sliding-window layers, and no host tiers")
        self.kv_cache = KVCache.from_arch(arch, num_pages, page_size, self.dtype, self.device, window_pages)
        self.layer_caches = self._layer_caches()  # what the model's forward takes, one entry per layer
        self.state_host = self.state_disk = None
        if self.state_cache is not None and host_state_records > 0:
            self.state_host = HostKVStore(self.state_cache.record_view, host_state_records)
            if host_state_disk_dir is not None:
                self.state_disk = DiskKVStore(host_state_disk_dir, self.state_host)
        self.host_store = HostKVStore(self.kv_cache, host_cache_pages) if host_cache_pages > 0 else None
        self.disk_store = DiskKVStore(host_disk_dir, self.host_store) if self.host_store and host_disk_dir else None
        if is_cuda:
            torch.cuda.synchronize(self.device)
        t3 = time.perf_counter()
        self.requests: dict[str, RequestState] = {}
        self.graphs = self._build_graphs(graph_plan, cuda_graphs, lazy_capture)
        self.one_pass = switches.one_pass  # a mixed step not run ahead: one prompt-graph replay (_one_pass_bucket)
        self.prompt_graphs = self._build_prompt_graphs() if switches.prompt_graphs else None
        # captures after construction (capture_pending): graphs, seconds, kernels compiled meanwhile
        self.num_background_graphs = 0
        self.background_capture_s = 0.0
        self.background_kernels_jit = 0
        # kernels JIT-compiled (or read from Triton's disk cache) at launches after this point (/metrics)
        self._jit_base = _kernels_jit() if is_cuda else 0
        self.step_capture_s = 0.0  # of the last execute, the seconds its captures took (EngineCore._observe)
        self._step_thread: int | None = None  # the thread of the last execute: captures must run on it
        if not switches.decode_overlap or tp is not None:
            decode_overlap = False
        self.decode_overlap = is_cuda if decode_overlap is None else decode_overlap  # may be flipped between steps
        self._overlap: DecodeOverlap | None = None  # made at the first graphed step (tests attach graphs late)
        # forward passes by kind (/metrics' graph launches): a decode graph's replay, the speculative next step's
        # replay, an eager forward (prefill, mixed batches, the CPU), a small prompt step's graph (prompt_graphs.py),
        # a mixed step's one-pass replay of a prompt graph (one_pass)
        self.launches: dict[str, int] = {"graph": 0, "speculative": 0, "eager": 0, "prompt_graph": 0, "one_pass": 0}
        self.replay_gpu_ns = 0  # GPU time of completed graph replays (/metrics' replay_gpu_ns)
        # CPU decode steps pick their intra-op thread count by timing (helios.runner.cpu_threads)
        self.decode_threads = None
        if self.device.type == "cpu" and decode_threads_are_exact(self.model, arch, torch.get_num_threads()):
            self.decode_threads = DecodeThreads(torch.get_num_threads())
        # steps with prompt rows take the policy too where the family's prefill ops are thread-exact as well
        self.prompt_threads = getattr(self.model, "prompt_steps_thread_exact", False)
        t4 = time.perf_counter()
        self.startup.kernels_wait_s, self.startup.load_s = t1 - t0 - weights_s, weights_s + t2 - t1
        self.startup.kv_alloc_s = t3 - t2
        self.startup.capture_s = t4 - t3
        self.startup.num_pages = num_pages

    @classmethod
    def from_core(cls, core, device: torch.device | str = "cpu", num_pages: int | None = None, **kwargs) -> ModelRunner:
        """A runner for a loaded core (helios.core.load.LoadedCore): its graph plan, page size, context
        length and precompiled kernels; kwargs go to the constructor (switches= among them)."""
        m = core.manifest
        kwargs.setdefault("max_model_len", m.limits.context_length)
        return cls(m.arch, core.tensors, num_pages, m.graph_plan.page_size, device, graph_plan=m.graph_plan,
                   core_path=core.path, kernel_targets=list(m.kernels), manifest=m, **kwargs)

    def _keep_host_tables(self, tensors: dict, mode: str, cache_rows: int, graph_plan: GraphPlan | None,
                          max_tokens: int | None) -> dict:
        """The tensors to bind, less the row tables that stay in host memory (self.host_embeddings, None if none)."""
        self.host_embeddings: HostEmbeddings | None = None
        family = model_class(self.arch.family)
        candidates = family.host_tables(self.arch) if hasattr(family, "host_tables") else []
        names = [] if self.tp is not None else choose_host_tables(candidates, tensors, mode, self.device, self.dtype)
        if not names:
            return tensors
        max_tokens = max_tokens or (graph_plan.prefill_chunk_size if graph_plan else 8192)
        context = self.context_tokens
        self.host_embeddings = build_host_embeddings(family, self.arch, tensors, names, self.device, self.dtype,
                                                     cache_rows, max_tokens, context[0] if context else 0)
        return {k: v for k, v in tensors.items() if k not in names}

    def _ready_host_rows(self, scheduled: list[ScheduledRequest], layout: BatchLayout,
                         requests: dict[str, RequestState] | None = None) -> None:
        """Before a forward of this layout is enqueued: the host tables' rows it reads resident in their device
        caches (runner/host_embedding.py); nothing without host tables."""
        if self.host_embeddings is None:
            return
        context = None
        if self.context_tokens is not None:
            count, pad_id = self.context_tokens
            requests = requests if requests is not None else self.requests
            rows = [requests[s.req_id].tokens_before(s.num_computed_tokens, count, pad_id) for s in scheduled]
            context = torch.tensor(rows, dtype=torch.int64).view(len(rows), count)
        self.host_embeddings.ready(layout.token_ids, layout.query_start_loc, context)

    @property
    def num_pages(self) -> int:
        return self.kv_cache.num_pages

    @property
    def overlap_hits(self) -> int:
        """Speculative decode steps whose logits a plan used."""
        return self._overlap.num_hits if self._overlap is not None else 0

    @property
    def overlap_misses(self) -> int:
        """Speculative decode steps dropped because the next plan was another step."""
        return self._overlap.num_misses if self._overlap is not None else 0

    @property
    def has_pending_captures(self) -> bool:
        """Whether decode buckets, or prompt buckets, are left for capture_pending."""
        return (self.graphs is not None and bool(self.graphs.pending)) or (
            self.prompt_graphs is not None and bool(self.prompt_graphs.pending))

    def capture_pending(self, bucket: int | None = None, prompt_bucket: int | None = None) -> bool:
        """Capture a pending decode bucket (`bucket`; None: the smallest; its graph and short-sequence variant), or
        once none is left a pending prompt bucket (`prompt_bucket`, or the smallest: runner/prompt_graphs.py);
        returns whether any remain. Tens of milliseconds a bucket on an 8B model: call it between steps, on the
        thread that runs `execute` (a capture uses the steps' stream and static buffers; a pending speculative step
        is dropped). execute itself captures a pending decode bucket its step needs, before running it: that step's
        capture seconds are `step_capture_s` (the engine leaves them out of the step's measured cost); a step of a
        pending prompt bucket runs eagerly instead."""
        if not self.has_pending_captures:
            return False
        if self._step_thread is not None and self._step_thread != threading.get_ident():
            raise RuntimeError("capture_pending must run on the thread that runs execute (the engine thread)")
        from helios.kernels.aot import JitCounter

        with JitCounter() as jit:
            if prompt_bucket is None and (bucket is not None or self.graphs.pending):
                num_graphs = self.graphs.num_graphs
                seconds = self.graphs.capture_next(bucket)
                self.num_background_graphs += self.graphs.num_graphs - num_graphs
            else:
                num_graphs = len(self.prompt_graphs.graphs)
                seconds = self.prompt_graphs.capture_next(prompt_bucket)
                self.num_background_graphs += len(self.prompt_graphs.graphs) - num_graphs
        self.background_capture_s += seconds
        self.step_capture_s += seconds
        self.background_kernels_jit += len(jit.names)
        return self.has_pending_captures

    def make_graphs(self, buckets: list[int], *, lazy: bool = False, capture: bool = True) -> GraphRunner:
        """A GraphRunner over this runner's model, caches, limits, window group and state scratch row: the one
        construction, so a test's graphs are the ones start-up builds. capture=False records nothing (its `run`
        calls the captured function eagerly: CPU tests attach it as `graphs`); lazy: see GraphRunner."""
        from helios.runner.cuda_graphs import GraphRunner

        return GraphRunner(
            self.model,
            self.kv_cache,
            buckets=buckets,
            max_model_len=self.max_model_len,
            page_size=self.page_size,
            vocab_size=self.arch.vocab_size,
            num_kv_heads=self.arch.num_kv_heads,
            device=self.device,
            capture=capture,
            lazy=lazy,
            window=self.window,
            state_scratch=self.scratch_slot,
            layer_caches=self.layer_caches,
        )

    def _build_graphs(self, graph_plan: GraphPlan | None, cuda_graphs: bool, lazy: bool):
        if self.device.type != "cuda":
            self.startup.graphs = "CPU"
            return None
        if not cuda_graphs:
            self.startup.graphs = "disabled"
            return None
        if self.tp is not None:  # a worker rank would have to replay the same graph: not built yet
            self.startup.graphs = "tensor parallel"
            return None
        from helios.kernels.aot import JitCounter
        from helios.runner.cuda_graphs import unsupported_reason

        reason = unsupported_reason(self.model, self.arch, self.device)
        if reason is not None:
            self.startup.graphs = reason
            warnings.warn(f"CUDA graphs off: {reason}", stacklevel=3)
            return None
        with JitCounter() as jit:
            graphs = self.make_graphs(graph_plan.decode_buckets if graph_plan else DEFAULT_DECODE_BUCKETS, lazy=lazy)
        self.startup.num_graphs = graphs.num_graphs
        self.startup.num_pending = len(graphs.pending)
        self.startup.kernels_jit = len(jit.names)
        return graphs

    def _build_prompt_graphs(self):
        from helios.runner.prompt_graphs import prompt_graph_reason

        reason = prompt_graph_reason(self.model, self.arch, self)
        if reason is not None:
            if self.graphs is not None:  # else startup.graphs says why
                self.startup.prompt_graphs = reason
            return None
        return self.make_prompt_graphs(capture=self.graphs.records_graphs)

    def make_prompt_graphs(self, *, capture: bool = True):
        """A PromptGraphs over this runner's model and caches (capture=False: CPU tests attach it as
        `prompt_graphs`; its `run` calls the captured function eagerly); with one_pass, the finer buckets and the
        rows for decodes beside the prompt chunks."""
        from helios.runner import prompt_graphs as pg

        sizes = dict(buckets=pg.ONE_PASS_BUCKETS, max_seqs=pg.ONE_PASS_MAX_SEQS) if self.one_pass else {}
        return pg.PromptGraphs(self.model, self.layer_caches, max_model_len=self.max_model_len,
                               page_size=self.page_size, vocab_size=self.arch.vocab_size, device=self.device,
                               capture=capture, **sizes)

    # --- the step ---------------------------------------------------------------------------------

    def stats(self) -> RunnerStats:
        """Its counters for /metrics, as data (EngineCore folds them into EngineMetrics)."""
        host = self.host_embeddings.counters() if self.host_embeddings is not None else {}
        pending = (len(self.graphs.pending) if self.graphs is not None else 0) + (
            len(self.prompt_graphs.pending) if self.prompt_graphs is not None else 0)
        jit = _kernels_jit() - self._jit_base if self.device.type == "cuda" else 0
        return RunnerStats(graph_launches=dict(self.launches), replay_gpu_ns=self.replay_gpu_ns,
                           graph_captures_pending=pending, kernels_jit=jit, **host)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.step_capture_s = 0.0
        self._apply_plan(plan)
        if not plan.scheduled:
            if self._overlap is not None:
                self._overlap.take(plan, None)  # every plan ends a pending speculation
            return ModelRunnerOutput(results=[])
        unknown = [s.req_id for s in plan.scheduled if s.req_id not in self.requests]
        if unknown:
            raise KeyError(f"scheduled request {unknown[0]} was never sent as a new request")
        self._step_thread = threading.get_ident()

        scheduled = plan.scheduled
        layout = layout_batch(scheduled, self.requests, self.page_size)
        bucket = self.graphs.bucket_for(scheduled, layout) if self.graphs is not None else None
        if bucket is not None and bucket in self.graphs.pending:
            self.capture_pending(bucket)  # its first step: capture now (one stall) rather than run eagerly until later
        overlap = self._decode_overlap()
        # NOTE: with no speculation pending (the scheduler held this step's prompts back: plan.hold_ahead), a mixed
        # step that one prompt graph holds runs in one pass without splitting off its decode rows first
        one_pass = (self._one_pass_bucket(scheduled, layout) if bucket is None and self.graphs is not None
                    and (overlap is None or overlap.pending is None) else None)
        split = self._split_mixed(scheduled) if bucket is None and self.graphs is not None and one_pass is None \
            else None
        speculate = None
        if one_pass is not None:
            logits = self._run_one_pass(scheduled, layout, one_pass)
        elif split is not None:
            # a mixed step whose decode rows are the pending speculation (the step before decoded the same rows,
            # and its prompts arrived since) takes their logits from it; else it ends the speculation, and runs as
            # one pass where a prompt graph holds it all (one_pass), else as the decode graph and a prompt pass
            decode, _, decode_bucket, _ = split
            is_speculated = overlap is not None and overlap.take(plan, decode_bucket, rows=decode)
            one_pass = None if is_speculated else self._one_pass_bucket(scheduled, layout)
            if one_pass is not None:
                logits = self._run_one_pass(scheduled, layout, one_pass)
            else:
                scheduled, layout, logits = self._run_split(*split, is_speculated=is_speculated)
        elif overlap is not None and overlap.take(plan, bucket):
            logits = self.graphs.logits_rows(layout, len(plan.scheduled))  # the speculative step's rows
        elif bucket is not None:
            self._ready_host_rows(plan.scheduled, layout)
            logits = self.graphs.run(plan.scheduled, layout, bucket)  # [N, V] float32, the graph's output rows
            self.launches["graph" if self.graphs.is_captured(bucket) else "eager"] += 1  # eager: a pending bucket
        elif self.decode_threads is not None and (layout.is_decode_only or self.prompt_threads):
            num_tokens = None if layout.is_decode_only else sum(len(s.token_ids) for s in scheduled)
            with self.decode_threads.run(len(layout.seq_lens), num_tokens):
                logits = self._forward(scheduled, layout)
        else:
            logits = self._prompt_forward(scheduled, layout)
        if (
            bucket is not None
            and overlap is not None
            and not plan.hold_ahead  # the next plan takes prompts beside these decodes, in one pass
            and speculable(plan.scheduled, self.requests, self.page_size, self.graphs.max_blocks)
        ):
            def speculate(token_ids: torch.Tensor) -> list[int]:
                self.launches["speculative"] += 1
                ids = overlap.launch(plan.scheduled, bucket, token_ids)
                if self.host_embeddings is not None and not self.host_embeddings.take_speculative(ids):
                    # it read host rows that were not resident (runner/host_embedding.py): the next plan reruns it
                    overlap.pending, overlap.num_misses = None, overlap.num_misses + 1
                return ids
        results = self._postprocess(scheduled, layout.rows, logits, speculate)
        if self.graphs is not None:
            self.replay_gpu_ns = self.graphs.timer.poll()  # this step's replays have completed (its tokens are read)
        return ModelRunnerOutput(results=results)

    @torch.inference_mode()
    def execute_shard(self, plan: SchedulerOutput) -> None:
        """A tensor-parallel worker rank's step (helios.runner.parallel): the plan's bookkeeping and copies, then
        the eager forward rank 0's execute runs, on this rank's shard. Rank 0 samples from the logits every rank
        gathers, so nothing comes back."""
        self._apply_plan(plan)
        if plan.scheduled:
            self._forward(plan.scheduled, layout_batch(plan.scheduled, self.requests, self.page_size))

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        """Everything of a plan before its forward: drops, new requests, the host tiers' and state slots' copies."""
        # NOTE: drops first: a preempted request can be dropped and re-sent as new in one plan.
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_requests:
            self.requests[new.req_id] = self._new_state(new)
        if plan.copy_out or plan.copy_in or plan.spill or plan.disk_drop or plan.load:
            self._copy_host_pages(plan)
        if plan.state_copies or plan.state_copy_out or plan.state_copy_in or plan.state_spill or plan.state_load:
            self._copy_states(plan)

    def _split_mixed(self, scheduled: list[ScheduledRequest]):
        """A mixed step's decode rows when a captured graph holds them: (decode rows, their layout, bucket, the
        other rows); None to run the step eagerly as one forward.

        NOTE: with requests arriving all the time nearly every step at high batch carries some prefill, and one
        eager forward over hundreds of decode rows cost more than the graph replay of those rows plus an eager
        forward of the prefill chunks alone (a second pass over the weights)."""
        decode = [s for s in scheduled if len(s.token_ids) == 1 and s.sample and not s.want_prompt_logprobs]
        if len(decode) < SPLIT_MIN_DECODE_ROWS or len(decode) == len(scheduled):
            return None
        decode_layout = layout_batch(decode, self.requests, self.page_size)
        bucket = self.graphs.bucket_for(decode, decode_layout)
        if bucket is not None and bucket in self.graphs.pending:
            self.capture_pending(bucket)
        if bucket is None or not self.graphs.is_captured(bucket):
            return None
        chosen = {id(s) for s in decode}
        return decode, decode_layout, bucket, [s for s in scheduled if id(s) not in chosen]

    def _run_one_pass(self, scheduled: list[ScheduledRequest], layout: BatchLayout, bucket: int) -> torch.Tensor:
        """A whole mixed step as one replay of the prompt graph of `bucket` (_one_pass_bucket's answer)."""
        self.launches["one_pass"] += 1
        return self.prompt_graphs.run(scheduled, layout, bucket)

    def _one_pass_bucket(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> int | None:
        """With one_pass, the captured prompt-graph bucket that holds a whole mixed step (decode rows beside prompt
        chunks: one pass over the weights instead of two), else None."""
        if not self.one_pass or self.prompt_graphs is None or layout.is_decode_only:
            return None
        if sum(len(s.token_ids) == 1 and s.sample for s in scheduled) < SPLIT_MIN_DECODE_ROWS:
            return None  # a prompt step (its prompt graph, _prompt_forward), not a mixed one
        bucket = self.prompt_graphs.bucket_for(scheduled, layout)
        return None if bucket is None or bucket in self.prompt_graphs.pending else bucket

    def _run_split(self, decode, decode_layout, bucket, rest, is_speculated: bool = False):
        """The eager forward of the prefill rows, then the decode rows' graph (is_speculated: the pending
        speculative step already ran them, its logits rows are read); (rows in logits order, their layout,
        logits [N, V] float32: the decode rows' first).

        NOTE: without the speculated rows every mixed step after a decode step ran the decode rows twice (the
        dropped speculation, then this graph): a whole decode step of GPU time in each step that takes prompts."""
        rest_logits = self._prompt_forward(rest, layout_batch(rest, self.requests, self.page_size))
        if is_speculated:
            decode_logits = self.graphs.logits_rows(decode_layout, len(decode))
        else:
            self._ready_host_rows(decode, decode_layout)
            decode_logits = self.graphs.run(decode, decode_layout, bucket)  # a view of the graph's static rows
            self.launches["graph"] += 1
        scheduled = decode + rest
        return scheduled, layout_batch(scheduled, self.requests, self.page_size), torch.cat([decode_logits, rest_logits])

    def _copy_host_pages(self, plan: SchedulerOutput) -> None:
        """The host tier's copies, before any forward of the plan: out first (the forward and the copy-ins write
        into the evicted pages), then in. On the device's stream, so they are ordered with the forwards."""
        self._host_tier_io("host", self.host_store, self.disk_store, self.kv_cache, plan.spill, plan.disk_drop,
                           plan.copy_out, plan.load, plan.copy_in)

    def _copy_states(self, plan: SchedulerOutput) -> None:
        """The state slots' copies and their host tiers', before any forward of the plan, in the plan's order:
        spill, disk drop, copy-out (evicted checkpoints), slot copies (captures, restores), load, copy-in."""
        if not (plan.state_spill or plan.state_disk_drop or plan.state_copy_out or plan.state_load
                or plan.state_copy_in):
            self.state_cache.copy(plan.state_copies)
            return
        self._host_tier_io("state", self.state_host, self.state_disk, self.state_cache.record_view,
                           plan.state_spill, plan.state_disk_drop, plan.state_copy_out, plan.state_load,
                           plan.state_copy_in, between=lambda: self.state_cache.copy(plan.state_copies))

    def _host_tier_io(self, kind: str, host, disk, records, spill, disk_drop, copy_out, load, copy_in,
                      between=None) -> None:
        """One host tier's plan operations over `records` (the KV cache, or the state slots' record view), in the
        plan's order (see messages.py): spill, drop, copy-out, `between` (the state slot copies), load, copy-in."""
        if host is None:
            raise RuntimeError(f"the plan copies {kind} records, but the runner has no host store for them")
        if spill or disk_drop or load:
            if disk is None:
                raise RuntimeError(f"the plan moves {kind} disk records, but the runner has no disk store for them")
            if host.is_cuda and (spill or load):
                # NOTE: the host reads and writes pinned slots that earlier asynchronous copies may still use
                torch.cuda.current_stream(self.device).synchronize()
            disk.spill(spill)
            disk.drop(disk_drop)
        host.copy_out(records, copy_out)
        if between is not None:
            between()
        if load:
            try:
                disk.load(load)
            except OSError as exc:
                # NOTE: no request is at fault: the engine forgets the plan's copies and the records it loaded and
                # runs its requests again from scratch (they recompute what the unreadable records held)
                raise RequestExecutionError(set(), f"{kind} disk tier: {exc}") from exc
        host.copy_in(records, copy_in)

    def _decode_overlap(self) -> DecodeOverlap | None:
        # NOTE: never with recurrent state: a speculative step advances it in place, and a dropped one would leave it
        # a token ahead (a dropped step's KV writes are harmless: the real step rewrites those slots)
        if not self.decode_overlap or self.graphs is None or self.state_cache is not None:
            if self._overlap is not None:
                self._overlap.pending = None  # switched off: a pending step is never used
            return None
        if self._overlap is None or self._overlap.graphs is not self.graphs:
            self._overlap = DecodeOverlap(self.graphs, self.page_size, self.device, self.window)
        return self._overlap

    def _layer_caches(self) -> list:
        return layer_caches(self.arch, self.kv_cache, self.state_cache)

    @property
    def scratch_slot(self) -> int | None:
        return self.state_cache.scratch_slot if self.state_cache is not None else None

    @property
    def context_tokens(self) -> tuple[int, int] | None:
        """(count, pad id) of the tokens before each sequence an n-gram model reads (qwen4_exp's PLE), else None."""
        ple = self.arch.ple
        return (ple.ngram_size - 1, ple.reset_token_id) if ple is not None else None

    def _forward(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> torch.Tensor:  # [N, V] float32
        self.launches["eager"] += 1
        batch = prepare_batch(scheduled, self.requests, self.page_size, self.device, layout, self.scratch_slot,
                              self.context_tokens, self.window)
        self._ready_host_rows(scheduled, layout)
        hidden = self.model.forward(batch.token_ids, batch.meta, self.layer_caches)  # [T, H]
        # float32 logits for the used rows only: sampling and logprobs both read the raw distribution
        rows = hidden if len(layout.logits_indices) == hidden.shape[0] else hidden[batch.logits_indices]
        return self.model.compute_logits(rows).float()

    def _prompt_forward(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> torch.Tensor:  # [N, V]
        """A step that no decode graph holds: its prompt graph's replay where one fits (a few short chunks), else
        the eager forward. NOTE: a replay's rows view static logits: read before the next prompt replay."""
        bucket = self.prompt_graphs.bucket_for(scheduled, layout) if self.prompt_graphs is not None else None
        # NOTE: a bucket not captured yet runs eagerly (the engine captures it when idle, capture_pending): a capture
        # inside the step would stall the first request's first token, and every decoding stream beside it
        if bucket is None or bucket in self.prompt_graphs.pending:
            return self._forward(scheduled, layout)
        self.launches["prompt_graph"] += 1
        return self.prompt_graphs.run(scheduled, layout, bucket)

    def _new_state(self, new: NewRequestData) -> RequestState:
        sampler_state = SamplerState(new.sampling, list(new.prompt_token_ids))
        # a request re-sent after preemption carries its outputs: they count for penalties again
        for token_id in new.output_token_ids:
            sampler_state.append(token_id)
        return RequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling=new.sampling,
            sampler_state=sampler_state,
        )

    def _postprocess(
        self,
        scheduled: list[ScheduledRequest],
        batch_rows: list[RequestRows],
        logits: torch.Tensor,  # [N, V] float32
        speculate=None,  # ids on the device -> ids on the host, after enqueueing the next step (no forced rows)
    ) -> list[RequestResult]:
        sampling_rows = [r for r in batch_rows if r.sample_row is not None]
        sampled: dict[str, int] = {}
        position_logprobs: dict[str, PositionLogprobs | None] = {}
        if sampling_rows:
            requests = self.requests
            states = [requests[r.req_id] for r in sampling_rows]
            sample_rows = [r.sample_row for r in sampling_rows]
            # a view when every row samples: an index list would copy to the device and sync the stream
            sample_logits = logits if sample_rows == list(range(logits.shape[0])) else logits[sample_rows]  # [B, V]
            # the engine's forced tokens (reasoning close at the thinking budget): not drawn, no logprob record
            forced = {s.req_id: s.forced_token_id for s in scheduled if s.forced_token_id is not None}
            forced_ids = [forced.get(r.req_id) for r in sampling_rows] if forced else None
            # logit_bias and structured output's masks, in a copy the draw alone reads
            masks = {s.req_id: s.token_mask for s in scheduled if s.token_mask is not None}
            biased = draw_logits(sample_logits,
                                 [masks.get(r.req_id) for r in sampling_rows] if masks else [None] * len(states),
                                 [st.sampling.logit_bias for st in states])
            # NOTE: sample() leaves its input untouched, so logprobs below read the raw distribution.
            sampler_states = [st.sampler_state for st in states]
            if speculate is not None:
                token_ids = speculate(sample_device(biased, sampler_states))
            else:
                token_ids = sample(biased, sampler_states, forced_ids)
            for row, state, token_id in zip(sampling_rows, sampler_states, token_ids):
                sampled[row.req_id] = token_id = int(token_id)
                state.append(token_id)
            want = [i for i, st in enumerate(states) if st.wants_logprobs and st.req_id not in forced]
            if want:
                records = logprobs_for(
                    sample_logits[want],
                    torch.tensor([token_ids[i] for i in want], device=logits.device),
                    [states[i].sampling.logprobs for i in want],
                    [states[i].sampling.logprob_token_ids for i in want],
                )
                for i, record in zip(want, records):
                    position_logprobs[states[i].req_id] = record

        results = []
        get_token, get_logprobs = sampled.get, position_logprobs.get
        for s, rows in zip(scheduled, batch_rows):
            prompt_records = None
            if s.want_prompt_logprobs:
                prompt_records = []
                if rows.prompt_next_token_ids:
                    n = len(rows.prompt_next_token_ids)
                    prompt_records = prompt_logprobs_for(
                        logits[rows.logits_start : rows.logits_start + n],
                        torch.tensor(rows.prompt_next_token_ids, device=logits.device),
                        self.requests[s.req_id].sampling.prompt_logprobs or 0,
                    )
            results.append(
                RequestResult(
                    req_id=s.req_id,
                    sampled_token_id=get_token(s.req_id),
                    logprobs=get_logprobs(s.req_id),
                    prompt_logprobs=prompt_records,
                )
            )
        return results

    # --- conveniences -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """[T, V] float32 logits of every position of one sequence, run through the paged path.

        For tests and scoring tools: it uses the *last* pages of the cache in reverse order (so the
        block table is not the identity) and overwrites them; do not mix with live requests.
        """
        num_blocks = (len(token_ids) + self.page_size - 1) // self.page_size
        if num_blocks > self.kv_cache.num_pages:
            raise ValueError(
                f"{len(token_ids)} tokens need {num_blocks} pages; the cache has {self.kv_cache.num_pages}"
            )
        block_ids = list(range(self.kv_cache.num_pages - 1, self.kv_cache.num_pages - 1 - num_blocks, -1))
        chunk_size = chunk_size or len(token_ids)
        group_block_ids = self._window_table(num_blocks, chunk_size) if self.window else []
        requests = {"forward_logits": RequestState("forward_logits", list(token_ids), SamplingParams())}
        out = []
        for start in range(0, len(token_ids), chunk_size):
            chunk = ScheduledRequest(
                req_id="forward_logits",
                token_ids=list(token_ids[start : start + chunk_size]),
                num_computed_tokens=start,
                block_ids=block_ids,
                group_block_ids=group_block_ids,
                sample=False,
            )
            layout = layout_batch([chunk], requests, self.page_size)
            batch = prepare_batch([chunk], requests, self.page_size, self.device, layout, self.scratch_slot,
                                  self.context_tokens, self.window)
            self._ready_host_rows([chunk], layout, requests)
            hidden = self.model.forward(batch.token_ids, batch.meta, self.layer_caches)
            out.append(self.model.compute_logits(hidden).float())
        return torch.cat(out)

    def _window_table(self, num_blocks: int, chunk_size: int) -> list[list[int]]:
        """forward_logits' window group table: its last pages in reverse order, cyclically. NOTE: a chunk reads and
        writes at most kv_groups.window_pages_per_request consecutive entries, which name distinct pages while that
        many fit the group; an entry reused is one whose keys are all before the window."""
        window_pages = self.window_pages
        needed = window_pages_per_request(self.window, self.page_size, chunk_size)
        if num_blocks > window_pages and needed > window_pages:
            raise ValueError(f"chunks of {chunk_size} tokens need {needed} window pages; the group has {window_pages}")
        return [[window_pages - 1 - j % window_pages for j in range(num_blocks)]]


def decode_threads_are_exact(model: torch.nn.Module, arch, max_threads: int) -> bool:
    """Whether the decode thread policy may switch counts: the model's first layer and logits weights give the
    same bits at 1 and `max_threads` threads (helios.runner.cpu_threads)."""
    first = model.layers[0] if hasattr(model, "layers") else model
    weights = [p for p in first.parameters() if p.dim() == 2]
    head = getattr(model, "lm_head", None)
    weights.append(head.weight if head is not None else model.embed.weight)
    return same_bits_across_threads(weights, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                    max_threads)
