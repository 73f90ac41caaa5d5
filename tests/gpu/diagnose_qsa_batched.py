"""Where qwen4_exp's 16-requests-together run parts from the alone runs on the GPU (tests/gpu/test_qwen4_exp_cuda.py's
failing check, float32): every QSA block choice of both runs is recorded with its margin (the last kept block's score
less the best dropped one's), keyed by layer, query position and the sequence's first raw index keys, and every MoE
routing with its margin (k-th best router logit less the next), keyed by layer, request and position; the choices
that differ between the runs are printed, earliest position first, with both margins. A margin near float32
rounding says the runs part at a tie of the discrete choice (summation order: the torch prefill path beside the
decode kernel); a large one says a wrong row. Decode runs eagerly (cuda_graphs=False: the hooks see every call;
the same kernels).

Run on the lent GPU: `python tests/gpu/diagnose_qsa_batched.py [--graphs]` (not collected by pytest)."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from helios.kernels import qsa_decode  # noqa: E402
from helios.layers import qsa  # noqa: E402

RECORDS: dict = {}  # run name -> {(layer, position, sequence key): (kept blocks, margin, top score)}
RUN = ["together"]
CONTEXT: list = []  # the decode call being run: (indexer, meta, index cache)
LAYERS: dict = {}  # (run, id(indexer)) -> its ordinal in the order of first calls: the layer's place in either engine


def layer(indexer) -> int:
    return LAYERS.setdefault((RUN[0], id(indexer)), len([k for k in LAYERS if k[0] == RUN[0]]))


def seq_key(rows: torch.Tensor) -> tuple:
    """The sequence's first three raw index keys, rounded: the same request in either run."""
    return tuple(round(v, 4) for v in rows[:3, :4].float().flatten().tolist())


def margin(scores: torch.Tensor, kept: int) -> tuple[list[int], float, float]:
    """(kept block ids sorted, last kept score - best dropped score, top score) of one query's visible scores."""
    order = torch.sort(scores, descending=True, stable=True)
    values, ids = order.values.tolist(), order.indices.tolist()
    gap = values[kept - 1] - values[kept] if len(values) > kept else math.inf
    return sorted(ids[:kept]), gap, values[0]


ROWS: list = []  # the current forward's token rows: (request id, position)
MOE_CALLS = [0]  # MoE routings so far in the current forward: the layer's ordinal


def patch_routing() -> None:
    """Every MoE routing's choice per token row and its margin (the k-th best logit less the (k+1)-th), keyed by
    ("moe", layer ordinal, request, position), through the runner's eager forward (the row map) and moe_route."""
    from helios.kernels import fused_moe
    from helios.layers import moe
    from helios.runner.model_runner import ModelRunner

    forward, route, torch_route = ModelRunner._forward, fused_moe.moe_route, moe.route

    def mapped_forward(self, scheduled, layout):
        ROWS[:] = [(s.req_id, s.num_computed_tokens + j) for s in scheduled for j in range(len(s.token_ids))]
        MOE_CALLS[0] = 0
        return forward(self, scheduled, layout)

    def record(logits: torch.Tensor, top_k: int) -> None:
        layer = MOE_CALLS[0]
        MOE_CALLS[0] += 1
        if len(ROWS) != logits.shape[0]:
            return
        ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
        gaps = (ranked.values[:, top_k - 1] - ranked.values[:, top_k]).tolist()
        chosen = ranked.indices[:, :top_k].sort(dim=-1).values.tolist()
        for row, (req_id, position) in enumerate(ROWS):
            RECORDS[RUN[0]][("moe", layer, req_id, position)] = (chosen[row], gaps[row], 0.0, "route")

    def recording_route(logits, top_k, *args, **kwargs):
        record(logits, top_k)
        return route(logits, top_k, *args, **kwargs)

    def recording_torch_route(logits, top_k, *args, **kwargs):
        record(logits, top_k)
        return torch_route(logits, top_k, *args, **kwargs)

    ModelRunner._forward = mapped_forward
    fused_moe.moe_route = recording_route
    moe.route = recording_torch_route


def patch() -> None:
    patch_routing()
    select, decode, scores_fn = qsa.Indexer.select, qsa.IndexedAttention._decode, qsa_decode.block_scores

    def recording_select(self, q, keys, first_pos):
        c = self.config
        num_queries = q.shape[0]
        num_blocks = (first_pos + num_queries) // c.block_size
        if num_blocks > c.num_blocks:
            block_keys = self.block_keys(keys[: num_blocks * c.block_size].view(num_blocks, c.block_size, -1))
            scores = torch.relu(torch.matmul(q.float(), block_keys.float().t())).sum(dim=1) / math.sqrt(c.head_dim)
            for i in range(num_queries):
                p = first_pos + i
                visible = (p + 1) // c.block_size
                if visible > c.num_blocks:
                    kept = margin(scores[i, :visible], c.num_blocks)
                    RECORDS[RUN[0]][(layer(self), p, seq_key(keys))] = (*kept, "torch")
        return select(self, q, keys, first_pos)

    def recording_scores(*args, **kwargs):
        out = scores_fn(*args, **kwargs)
        if CONTEXT:
            indexer, meta, index_cache = CONTEXT[-1]
            c = indexer.config
            lens = meta.seq_lens.tolist()
            for b, n in enumerate(lens):
                visible = n // c.block_size  # the decode query sits at n - 1
                if n <= 0 or visible <= c.num_blocks:
                    continue
                first_page = int(meta.block_tables[b, 0])
                rows = index_cache[0, first_page]
                key = (layer(indexer), n - 1, seq_key(rows))
                RECORDS[RUN[0]][key] = (*margin(out[b, :visible].float(), c.num_blocks), "kernel")
        return out

    def recording_decode(self, q, k, v, index_q, index_k, cos_sin, kv_cache, index_cache, meta):
        CONTEXT.append((self.indexer, meta, index_cache))
        try:
            return decode(self, q, k, v, index_q, index_k, cos_sin, kv_cache, index_cache, meta)
        finally:
            CONTEXT.pop()

    qsa.Indexer.select = recording_select
    qsa.IndexedAttention._decode = recording_decode
    qsa_decode.block_scores = recording_scores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--graphs", action="store_true", help="decode graphs on (the hooks then see captures only)")
    parser.add_argument("--device", default="cuda", help="cpu: the torch path alone (a dry run of this script)")
    parser.add_argument("--seed", type=int, default=10, help="request i's prompt seed is this + i (the test's: 10)")
    args = parser.parse_args()
    from ignition.export import ExportOptions, export_core
    from helios.core.load import load_core
    from tests.gpu.family_cuda import cuda_engine
    from tests.models.hybrid_harness import generate, greedy_request, prompt, window_engine
    from tests.models.qwen4_exp_tiny import build_qwen4_exp
    from tests.models.test_qwen4_exp import TIE_FREE

    patch()
    root = Path(tempfile.mkdtemp(prefix="qsa-diag-"))
    core = load_core(export_core(build_qwen4_exp("plain", root / "hf", **TIE_FREE), root / "core",
                                 ExportOptions(dtype="float32")))
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=args.seed + i), 12) for i in range(16)]
    RECORDS["together"] = {}

    def engine(max_concurrency: int, budget: int, chunk: int):
        if args.device == "cpu":
            return window_engine(core, max_concurrency, 512, chunk, budget)
        return cuda_engine(core, max_concurrency, budget, chunk, cuda_graphs=args.graphs)

    together = generate(engine(16, 128, 64), reqs)
    alone_engine = engine(1, 512, 512)
    RUN[0] = "alone"
    RECORDS["alone"] = {}
    parted = 0
    for r in reqs:
        got = generate(alone_engine, [r])[r.req_id]
        if got == together[r.req_id]:
            continue
        parted += 1
        k = next(i for i, (a, b) in enumerate(zip(together[r.req_id], got)) if a != b)
        print(f"{r.req_id}: parts at output {k} (prompt {len(r.prompt_token_ids)} tokens): together "
              f"{together[r.req_id]}, alone {got}")
    for kind, position_at in (("QSA block choices", 1), ("MoE routings", 3)):
        keys = [k for k in set(RECORDS["together"]) & set(RECORDS["alone"]) if (k[0] == "moe") == (position_at == 3)]
        keys.sort(key=lambda key: key[position_at])
        differing = [key for key in keys if RECORDS["together"][key][0] != RECORDS["alone"][key][0]]
        print(f"{kind} in both runs: {len(keys)}, differing {len(differing)}; requests parted: {parted}")
        gaps = sorted((min(RECORDS["together"][key][1], RECORDS["alone"][key][1]), key) for key in keys)
        print("  smallest margins over them:", ", ".join(f"{g:.3e} at {key}" for g, key in gaps[:6]))
        for key in differing[:10]:
            t, a = RECORDS["together"][key], RECORDS["alone"][key]
            print(f"  {key}: together {t[0]} margin {t[1]:.3e} top {t[2]:.4f} ({t[3]}); alone {a[0]} margin "
                  f"{a[1]:.3e} top {a[2]:.4f} ({a[3]})")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
