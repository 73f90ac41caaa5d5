"""CUDA graphs of small prompt steps: the eager forward of a few short prompt chunks, replayed from static inputs.

Why: an eager forward costs the host a few hundred microseconds a layer (about ten kernel launches through
Triton's and torch's Python paths), whatever few tokens it carries. On the 8B shape that is ~11 ms of host time per
step that takes prompts (benchmarks/gpu_prompt_step.py: 2.9 ms fixed at 8 layers), against a 5-12 ms decode step:
the served load's prompt steps cost two decode steps each, which priced the scheduler's prompt budget (and the
ITL tail: a decode row waits for that step) far above the GPU work. A graph replays those launches in one call.

What qualifies (PromptGraphs.bucket_for): at most `max_seqs` sequences and `buckets[-1]` tokens, no prompt-logprob
rows (at most one logits row a sequence), every block table inside the static width. The step's tokens are padded
to the smallest token bucket that holds its sequences (bucket_seqs: fewer than its tokens): padded tokens belong
to no sequence (query_start_loc stops at the real count; the padded sequences hold zero queries and zero keys),
write no KV (slot -1) and their rows are never read; their logits rows gather row 0. Only for models whose forward
decides nothing on host values but shapes (the dense attention families on the Triton backend:
`prompt_graph_reason`), so one capture per bucket holds for every step.
The buckets are captured between steps (ModelRunner.capture_pending: when the engine is idle, and under load one
unit per its background interval); until then a bucket's steps run eagerly, as without these graphs. With
capture=False nothing is recorded and `run` calls the captured function eagerly (CPU tests: the Triton interpreter
stands in for the device).
One-pass steps (switch one_pass; ModelRunner._one_pass_bucket): the same graphs with finer buckets and up to 72
sequences (a bucket holds fewer sequences than tokens: seqs_for) take a whole mixed step, its decode rows as one-token
chunks beside the prompt chunks, in one pass over the weights; the decode graph plus a prompt graph make two.
Imports torch, helios.layers.attention (metadata) and the runner's input_batch and cuda_graphs (PinnedSlots).
"""

from __future__ import annotations

import time
import warnings

import torch

from helios.engine.messages import ScheduledRequest
from helios.layers.attention import AttentionMetadata
from helios.runner.cuda_graphs import PinnedSlots, recording
from helios.runner.input_batch import BatchLayout, max_table_blocks, prepare_batch, round_up

PROMPT_BUCKETS = (32, 64, 128, 256, 512)  # token counts; past 512 a step's GPU work dwarfs its launches
PROMPT_MAX_SEQS = 8
# one-pass steps (switch one_pass): decode rows ride in the prompt graph beside the prompt chunks; finer buckets,
# since a step's padded tokens cost matmul time (~17 us a token on the 8B shape) while its decode rows wait
ONE_PASS_BUCKETS = (32, 64, 96, 128, 160, 192, 256, 320, 384, 512)
ONE_PASS_MAX_SEQS = 72
# and the prompt tokens a step takes beside decodes (SchedulerConfig.prompt_step_tokens): prompts held back a step
# arrive together, and at 512 two or three of them made the ITL tail (benchmarks/scheduler_sim.py: 64 streams
# p99 2.13x its p50 at 512, 1.77x at 256)
ONE_PASS_PROMPT_TOKENS = 256
# rows of the packed int64 input buffer
TOKEN_IDS, POSITIONS, SLOT_MAPPING, LOGITS_INDICES = range(4)


def bucket_seqs(bucket: int, max_seqs: int) -> int:
    """The sequences a bucket's graph holds. NOTE: always fewer than its tokens: the attention backend reads "one token
    a sequence" as a decode batch (TritonAttentionBackend._attend)."""
    return min(max_seqs, bucket - 1)


def prompt_graph_reason(model: torch.nn.Module, arch, runner) -> str | None:
    """Why this runner's prompt steps cannot replay graphs, or None when they can. Beyond the decode graphs'
    conditions (runner.graphs exists): a family that declares its forward shape-driven (`prompt_graph_safe`), no
    MoE routing (its expert counts vary with the data), no recurrent state, no n-gram context, no window page group,
    no host-resident tables."""
    if runner.graphs is None:
        return "no decode graphs"
    if not getattr(model, "prompt_graph_safe", False):
        return f"{type(model).__name__} does not declare its prompt forward shape-driven"
    if arch.moe is not None or arch.recurrent is not None or getattr(arch, "ple", None) is not None:
        return "MoE, recurrent or PLE layers"
    if runner.window is not None or runner.host_embeddings is not None or runner.state_cache is not None:
        return "a window page group, host-resident tables or state slots"
    return None


class PromptGraphs:
    """Static inputs, one graph per token bucket, and the float32 logits rows of the last replay."""

    def __init__(self, model, layer_caches: list, *, buckets: tuple[int, ...] = PROMPT_BUCKETS,
                 max_seqs: int = PROMPT_MAX_SEQS, max_model_len: int, page_size: int, vocab_size: int,
                 device: torch.device, capture: bool = True):
        self.buckets = sorted(set(buckets))
        assert self.buckets[0] > 1, "a bucket holds at least one sequence"
        self.model = model
        self.layer_caches = layer_caches
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.device = torch.device(device)
        self.width = max_table_blocks(max_model_len, page_size)
        tokens, seqs = self.buckets[-1], max_seqs
        # int32 inputs packed flat, each part 16-byte aligned: query starts, sequence lengths, block tables
        self._lens_at = round_up(seqs + 1, 4)
        self._tables_at = round_up(self._lens_at + seqs, 4)
        size32 = self._tables_at + seqs * self.width
        self.packed = torch.zeros(4, tokens, dtype=torch.int64, device=self.device)
        self.packed32 = torch.zeros(size32, dtype=torch.int32, device=self.device)
        self.logits = torch.zeros(seqs, vocab_size, dtype=torch.float32, device=self.device)
        self._staging = PinnedSlots(lambda pin: (torch.zeros(4, tokens, dtype=torch.int64, pin_memory=pin),
                                                 torch.zeros(size32, dtype=torch.int32, pin_memory=pin)), self.device)
        self.records_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.pending: list[int] = list(self.buckets)  # captured by capture_next between steps, smallest first
        self.uncaptured: list[int] = []  # out of memory at capture: eager for good
        self.num_replays = 0
        self._pad()

    # --- inputs -----------------------------------------------------------------------------------

    def seqs_for(self, bucket: int) -> int:
        return bucket_seqs(bucket, self.max_seqs)

    def bucket_for(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> int | None:
        """The token bucket that replays this step, or None when it runs eagerly."""
        num_tokens, num_seqs = len(layout.token_ids), len(scheduled)
        if num_seqs > self.max_seqs or num_tokens > self.buckets[-1]:
            return None
        if any(s.want_prompt_logprobs or len(s.block_ids) > self.width for s in scheduled):
            return None
        bucket = next((b for b in self.buckets if b >= num_tokens and self.seqs_for(b) >= num_seqs), None)
        return None if bucket in self.uncaptured else bucket

    def _tables(self, host32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs = self.max_seqs
        return (host32[: seqs + 1], host32[self._lens_at : self._lens_at + seqs],
                host32[self._tables_at :].view(seqs, self.width))

    def _load(self, scheduled: list[ScheduledRequest], layout: BatchLayout, bucket: int) -> None:
        """The step's inputs, padded, into the static buffers: filled on the host (the eager batch's own tensors,
        prepare_batch), then two contiguous asynchronous copies."""
        batch = prepare_batch(scheduled, {}, self.page_size, "cpu", layout)
        num_tokens, num_seqs, num_rows = len(layout.token_ids), len(scheduled), len(layout.logits_indices)
        meta = batch.meta
        with self._staging.take() as (host, host32):
            for row, values, pad in ((TOKEN_IDS, batch.token_ids, 0), (POSITIONS, meta.positions, 0),
                                     (SLOT_MAPPING, meta.slot_mapping, -1)):
                host[row, :num_tokens].copy_(values)
                host[row, num_tokens:bucket].fill_(pad)
            host[LOGITS_INDICES, :num_rows].copy_(batch.logits_indices)
            host[LOGITS_INDICES, num_rows : self.max_seqs].fill_(0)
            starts, lens, tables = self._tables(host32)
            starts[: num_seqs + 1].copy_(meta.query_start_loc)
            starts[num_seqs + 1 :].fill_(num_tokens)  # padded sequences: zero queries
            lens[:num_seqs].copy_(meta.seq_lens)
            lens[num_seqs:].fill_(0)
            tables.zero_()
            width = min(meta.block_tables.shape[1], self.width)
            tables[:num_seqs, :width].copy_(meta.block_tables[:, :width])
            self.packed.copy_(host, non_blocking=True)
            self.packed32.copy_(host32, non_blocking=True)

    def _pad(self) -> None:
        """Every token and sequence a padded one: what capture runs on (no KV write, no KV read)."""
        self.packed.zero_()
        self.packed[SLOT_MAPPING].fill_(-1)
        self.packed32.zero_()

    # --- the captured computation -----------------------------------------------------------------

    def _forward(self, bucket: int) -> None:
        """Static inputs -> static float32 logits rows [max_seqs, V]."""
        starts, lens, tables = self._tables(self.packed32)
        seqs = self.seqs_for(bucket)  # _load pads every sequence past the step's: zero queries, zero keys
        # NOTE: the host lists are what capture sees: max query length = the bucket (the prefill grid's size)
        meta = AttentionMetadata(
            positions=self.packed[POSITIONS, :bucket],
            slot_mapping=self.packed[SLOT_MAPPING, :bucket],
            query_start_loc=starts[: seqs + 1],
            seq_lens=lens[:seqs],
            block_tables=tables[:seqs],
            query_start_loc_cpu=[0] + [bucket] * seqs,
            seq_lens_cpu=[self.max_model_len] * seqs,
        )
        hidden = self.model.forward(self.packed[TOKEN_IDS, :bucket], meta, self.layer_caches)
        rows = hidden.index_select(0, self.packed[LOGITS_INDICES, :seqs])
        self.logits[:seqs].copy_(self.model.compute_logits(rows))

    @torch.inference_mode()
    def capture_next(self, bucket: int | None = None) -> float:
        """Capture a pending bucket (None: the smallest); returns the seconds it took. Out of device memory, the
        bucket stays eager for good (a warning says so), as when capture refuses a launch."""
        bucket = self.pending[0] if bucket is None else bucket
        t0 = time.perf_counter()
        self.pending.remove(bucket)
        if not self.records_graphs:
            return time.perf_counter() - t0
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self._pad()
            self._forward(bucket)  # warm-up: loads this bucket's kernels, sets up cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with recording(graph, self.pool):
                self._forward(bucket)
            self.graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # out of memory (torch.cuda.OutOfMemoryError), or a launch capture refuses
            self.uncaptured.append(bucket)
            self.graphs.pop(bucket, None)
            warnings.warn(f"CUDA graph of prompt bucket {bucket} not captured (its steps stay eager): {exc}",
                          stacklevel=2)
        return time.perf_counter() - t0

    # --- replay -----------------------------------------------------------------------------------

    def run(self, scheduled: list[ScheduledRequest], layout: BatchLayout, bucket: int) -> torch.Tensor:
        """[N, V] float32 logits of the layout's logits rows (a view of the static rows: read them before the next
        replay). A bucket not captured runs the captured function eagerly (capture=False: the CPU tests)."""
        self._load(scheduled, layout, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:  # capture=False: the same function, eagerly (a bucket that failed capture never gets here)
            self._forward(bucket)
        self.num_replays += 1
        return self.logits[: len(layout.logits_indices)]
