"""Tensor parallelism over torch.distributed: the process group, the sharding rules, rank 0's runner and the
worker loop of the other ranks.

One process per rank (per GPU; gloo on the CPU, NCCL on GPUs, the same code). Rank 0 owns the scheduler and the
engine: its `TensorParallelRunner` broadcasts each plan (the engine's SchedulerOutput, msgpack as the engine's other
messages cross processes in helios/engine/remote.py) before executing it; every other rank runs `worker_loop`: it
receives the plan, runs the same forward on its shard (ModelRunner.execute_shard) and returns nothing, since rank 0
samples from the logits every rank gathers. Weights are cut at load time from the core's full tensors
(`shard_tensors`): views where a rank's slice is contiguous (vocabulary rows, whole experts), a copy where it is not.
Nothing about the shards is recorded in the core.

Families (SHARDED_FAMILIES): llama, qwen2, qwen3, qwen3_moe (helios.models.llama / qwen3_moe), the hybrids qwen3_5,
qwen3_5_moe, qwen3_next (helios.models.qwen3_5), mimo_v2_flash, step3p7, muse_spark, gemma4, minimax_m3, nemotron_h and
kimi_linear. Per layer: attention by head (q, k, v and the output gate column parallel: qwen3_5's and muse_spark's gate
rows and step3p7's one row per head split with their heads, mimo_v2_flash's sinks too; o row parallel; a sliding layer's
own KV and query head counts and a full layer's own KV heads and head dim (gemma4; its k = v layers without v rows)
split as the others; a KV-shared layer's q heads read its source layer's pages on the same rank; fewer KV heads than
ranks: one on each rank, replicated; minimax_m3's lightning indexer's query heads split with the query heads they select
for, one replicated when fewer than ranks, its one index key whole on every rank), a dense MLP by width (gate_up column,
down row parallel; per-layer SwiGLU clamps act elementwise, unchanged), a MoE layer by whole experts (the router, its
score bias and a shared expert with its gate replicated; muse_spark's latent projections and norms too), the gated delta
rule by head (its q/k/v/z/b/a projection rows, the short convolution's channels, dt_bias and A_log split by key head and
the value heads that read it; each rank's recurrent state holds its heads only; out row parallel), Kimi delta attention
alike (q, k, v, b, the conv's channels, f_b / g_b rows, dt_bias and A_log by head; the low-rank gate inputs f_a / g_a
whole), a Mamba-2 mixer alike (its z/x/B/C/dt rows, the conv's x/B/C channels, dt_bias, A_log, D and the gated norm
split by B/C group and the heads that read it; out row parallel), MLA by head (q or q_b and kv_b rows; the kv latent,
its norm and the rope key whole, so every rank pages the same latents; o row parallel); the embedding and the head by
vocabulary rows (a final soft-cap after the gather). What acts per channel of the whole stream (norms, muse_spark's
residual gates, gemma4's layer scalars and per-layer embeddings) or per head (q/k norms, NoPE) is replicated or
unchanged. A size that does not split raises, naming the architecture field.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from helios.core.manifest import Architecture
from helios.engine.messages import ModelRunnerOutput, SchedulerOutput
from helios.layers.parallel import TensorGroup
from helios.runner.model_runner import ModelRunner

# NOTE: NVLink multicast (NVLS) stays off in every process of a group and in their children: set before any
# communicator exists, and inherited by what they spawn
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# the families whose model classes take `tp`: helios.models.llama's, qwen3_5's, mimo_v2_flash's, step3p7's,
# muse_spark's, gemma4's, minimax_m3's, nemotron_h's and kimi_linear's
SHARDED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "mimo_v2_flash",
                    "step3p7", "muse_spark", "gemma4", "minimax_m3", "nemotron_h", "kimi_linear")
GROUP_TIMEOUT = timedelta(minutes=10)  # a rank waits this long at a collective before giving up


def multicast_off() -> None:
    """NVLink multicast off in this process's environment (and so in every child it starts)."""
    os.environ.update(MULTICAST_OFF)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a tensor-parallel group: `tp` for the model's collectives, and `control`, the gloo
    group the plans travel in (host bytes; on GPUs beside the NCCL group, on the CPU the same group)."""

    tp: TensorGroup
    control: Any

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == 0


def init_ranks(rank: int, world_size: int, address: str, port: int, device: str = "cpu") -> Ranks:
    """Join the group of `world_size` processes meeting at address:port (rank 0 listens there): NCCL when the
    device is a GPU (this rank's GPU made current), gloo otherwise."""
    multicast_off()
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if is_cuda else "gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT)
    control = dist.new_group(backend="gloo") if is_cuda else dist.group.WORLD
    return Ranks(TensorGroup(rank, world_size, dist.group.WORLD), control)


# --- sharding rules ------------------------------------------------------------------------------------------------


def shard_arch(arch: Architecture, tp: TensorGroup) -> Architecture:
    """The architecture one rank runs: its attention heads (sliding_num_heads too), KV heads (sliding_num_kv_heads
    and full_num_kv_heads too; its KV cache holds those; one replicated when there are fewer than ranks:
    kv_heads_per_rank), dense MLP width and gated-delta heads (its recurrent state slots hold those); the
    vocabulary and the experts stay whole (their layers slice them by rank). Raises for a family or a size that does
    not split, naming the field."""
    if arch.family not in SHARDED_FAMILIES:
        raise ValueError(f"tensor parallelism covers {', '.join(SHARDED_FAMILIES)}; not {arch.family!r}")
    w = tp.world_size
    split = {"num_heads": arch.num_heads}
    if arch.sliding_num_heads is not None:  # step3p7: the sliding layers' own query heads
        split["sliding_num_heads"] = arch.sliding_num_heads
    if has_dense_mlp(arch):
        split["intermediate_size"] = arch.intermediate_size
    for name, size in split.items():
        tp.split(size, name)
    if arch.moe is not None:
        tp.split(arch.moe.num_experts, "moe.num_experts")
    local = {name: size // w for name, size in split.items()}
    for name in ("num_kv_heads", "sliding_num_kv_heads", "full_num_kv_heads"):
        if getattr(arch, name) is not None:
            local[name] = kv_heads_per_rank(getattr(arch, name), tp, name)
    if arch.recurrent is not None:
        local["recurrent"] = _shard_recurrent(arch, tp)
    if arch.msa is not None:  # minimax_m3's index heads: split with the query heads that read them (_shard_indexer)
        local["msa"] = msgspec.structs.replace(
            arch.msa, num_heads=kv_heads_per_rank(arch.msa.num_heads, tp, "msa.num_heads (index_n_heads)"))
    return msgspec.structs.replace(arch, **local)


def kv_heads_per_rank(num_kv_heads: int, tp: TensorGroup, what: str) -> int:
    """KV heads one rank holds: an even share, or with fewer KV heads than ranks (world_size a multiple of them)
    one, replicated on world_size / num_kv_heads ranks: a rank's num_heads / world_size q heads then all lie in the
    group of num_heads / num_kv_heads that reads it. Raises naming `what` otherwise."""
    w = tp.world_size
    if num_kv_heads % w == 0:
        return num_kv_heads // w
    if w % num_kv_heads:
        raise ValueError(f"{what} = {num_kv_heads} neither splits over {w} ranks nor divides them")
    return 1


def _kv_rows(t: torch.Tensor, offset: int, num_kv_heads: int, size: int, tp: TensorGroup) -> torch.Tensor:
    """This rank's rows of a k or v block (num_kv_heads heads of `size` rows from `offset`): its share, or its one
    replicated head (kv_heads_per_rank)."""
    if num_kv_heads % tp.world_size == 0:
        start, end = tp.split(num_kv_heads * size, "rows")
        return t[offset + start : offset + end]
    head = tp.rank // (tp.world_size // num_kv_heads)
    return t[offset + head * size : offset + (head + 1) * size]


def has_dense_mlp(arch: Architecture) -> bool:
    """Whether some layer has a dense MLP of intermediate_size (a MoE family's dense_layers, no MoE at all, or
    gemma4's MLP beside the MoE block in every layer)."""
    return arch.moe is None or bool(arch.moe.dense_layers) or arch.gemma4 is not None


def _shard_recurrent(arch: Architecture, tp: TensorGroup):
    """The recurrent heads of one rank: the gated delta rule's num_key_heads / world_size q/k heads and the value
    heads that read them (value head j reads key head j // (num_heads / num_key_heads): contiguous key heads carry
    contiguous value heads, so each key head stays on one rank with its value heads); Mamba-2's B/C groups and the
    heads that read them alike (its gated norm's groups, one per B/C group, stay whole on their rank)."""
    r = arch.recurrent
    if r.kind == "mamba2":  # nemotron_h: head h reads B/C group h // (num_heads / n_groups), as GDN's key heads
        tp.split(r.num_key_heads, "recurrent.num_key_heads (n_groups)")
        tp.split(r.num_heads, "recurrent.num_heads (mamba_num_heads)")
        group = r.norm_group_size or r.value_head_dim
        if (r.num_heads // tp.world_size * r.value_head_dim) % group:
            raise ValueError(f"recurrent.norm_group_size = {group} straddles the ranks' mamba heads")
    elif r.kind == "kimi_delta":  # kimi_linear's KDA: q, k, v and the state share one head count
        tp.split(r.num_heads, "recurrent.num_heads (linear_attn_config.num_heads)")
    elif r.kind == "gated_delta":
        tp.split(r.num_key_heads, "recurrent.num_key_heads (linear_num_key_heads)")
        tp.split(r.num_heads, "recurrent.num_heads (linear_num_value_heads)")
    else:
        raise ValueError(f"tensor parallelism covers gated_delta, mamba2 and kimi_delta recurrent layers; not "
                         f"{r.kind!r}")
    return msgspec.structs.replace(r, num_heads=r.num_heads // tp.world_size,
                                   num_key_heads=r.num_key_heads // tp.world_size)


_REPLICATED = re.compile(r"(norm|attn_norm|mlp_norm|attn\.q_norm|attn\.k_norm|moe\.router|linear\.norm"
                         r"|moe\.shared\.gate_up|moe\.shared\.up|moe\.shared\.down|moe\.shared_gate|mlp_post_norm"
                         r"|attn_residual|mlp_residual|moe\.latent_(in|out|norm)|moe\.expert_norm"
                         r"|attn_post_norm|mlp_post_norm_1|moe_norm|moe_post_norm|ple_gate|ple_proj|ple_post_norm"
                         r"|ple\.embed|ple\.proj|ple\.norm|attn\.indexer\.q_norm|attn\.indexer\.k_norm"
                         r"|kda\.norm|mla\.q_a_norm|mla\.kv_a_norm)\.weight"
                         r"|moe\.router\.bias|layer_scalar")


def shard_tensors(arch: Architecture, tensors: dict[str, torch.Tensor], tp: TensorGroup) -> dict[str, torch.Tensor]:
    """This rank's tensors, named as the core names them, cut from the core's full ones (`arch`: the full one).

    Column parallel (rows split): qkv (its q, k, v and output-gate heads), attention sinks, gate_up (its gate and up
    rows), the gated delta rule's in_proj (its q, k, v, z, b and a heads), conv (its q, k and v channels), dt_bias and
    A_log; row parallel (input columns split): o, down, the gated delta rule's out; vocabulary rows: embed, lm_head;
    whole experts: a MoE layer's gate_up and down; replicated: norms, q/k norms, the gated norm, the router, a shared
    expert and its gate, the router's score bias, muse_spark's residual gates and its latent projections and norms,
    gemma4's per-layer embeddings (ple.*, ple_gate / ple_proj) and layer scalars; minimax_m3's indexer qk by index head
    (_shard_indexer), its norms replicated; a Mamba-2 mixer's in_proj, conv, dt_bias, A_log, D and gated norm by head
    and group (_shard_mamba), its out row parallel; a relu2 MLP's up column parallel; Kimi delta attention by head
    (_shard_kda) and MLA by head (_shard_mla), the latents and their norms replicated, their out / o row parallel. An
    unknown tensor raises, so a layout this does not know never runs half-sharded."""
    out = {}
    for name, t in tensors.items():
        if name.startswith("mtp."):  # draft modules: mapped whole on the host, never bound (ModelRunner.draft_tensors)
            out[name] = t
            continue
        layer_key = name.split(".", 2)[-1] if name.startswith("layers.") else name
        out[name] = _shard_one(layer_key, name, t, arch, tp)
    return out


def _shard_one(key: str, name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    if key in ("embed.weight", "lm_head.weight"):
        start, end = tp.vocab_range(arch.vocab_size)
        return t[start:end]  # a view of the mapped core
    if _REPLICATED.fullmatch(key):
        return t
    if key in ("attn.qkv.weight", "attn.qkv.bias"):
        return _shard_qkv(name, t, arch, tp)
    if key == "attn.sinks":
        return _blocks(t, [layer_q_heads(arch, int(name.split(".")[1]))], tp)
    if key == "mlp.gate_up.weight":
        inter = t.shape[0] // 2
        return _blocks(t, [inter, inter], tp)
    if key == "mlp.up.weight":  # a relu2 MLP (nemotron_h)
        return _blocks(t, [t.shape[0]], tp)
    if key in ("attn.o.weight", "mlp.down.weight", "linear.out.weight", "mamba.out.weight", "kda.out.weight",
               "mla.o.weight"):
        start, end = tp.split(t.shape[1], f"{name} columns")
        # NOTE: a column slice is strided: one copy here rather than one inside every product
        return t[:, start:end].contiguous()
    if key in ("moe.gate_up.weight", "moe.up.weight", "moe.down.weight"):
        start, end = tp.split(t.shape[0], "num_experts")
        return t[start:end]  # whole experts: a view
    if key.startswith("linear."):
        return _shard_gated_delta(key, name, t, arch, tp)
    if key == "attn.indexer.qk.weight":
        return _shard_indexer(t, arch, tp)
    if key.startswith("mamba."):
        return _shard_mamba(key, name, t, arch, tp)
    if key.startswith("kda."):
        return _shard_kda(key, name, t, arch, tp)
    if key.startswith("mla."):
        return _shard_mla(key, name, t, arch, tp)
    raise ValueError(f"no tensor-parallel rule for core tensor {name}")


def _shard_qkv(name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """Attention's fused rows [q (Nq*D), k (Nkv*D), v (Nkv*Dv)] and an output gate after them (qwen3_5's and
    muse_spark's Nq*D rows, step3p7's one row per head): this rank's q and gate heads, and its KV heads (its share,
    or its one replicated head). The layer's own shapes: a sliding layer's KV and q head counts (mimo_v2_flash,
    step3p7), a full layer's KV heads and head dim (gemma4, whose k = v full layers have no v rows and whose KV-shared
    layers only q rows)."""
    i = int(name.split(".")[1])
    nkv, d = arch.kv_shape(i)
    nq = layer_q_heads(arch, i)
    parts, offset = [_blocks(t[: nq * d], [nq * d], tp)], nq * d
    for size in _kv_head_rows(arch, i, d):  # k's rows per head, then v's
        parts.append(_kv_rows(t, offset, nkv, size, tp))
        offset += nkv * size
    gate_rows = 0 if not arch.attn_output_gate else nq if arch.attn_gate_per_head else nq * d
    if gate_rows:  # the gate rows follow v's
        parts.append(_blocks(t[offset:], [gate_rows], tp))
    if offset + gate_rows != t.shape[0]:
        raise ValueError(f"{name}: {t.shape[0]} rows, not the heads' {offset + gate_rows}")
    return torch.cat(parts)


def _kv_head_rows(arch: Architecture, i: int, d: int) -> list[int]:
    """Rows per KV head of the k and v blocks in layer i's qkv: [D, Dv]; gemma4's full k = v layers [D] (v is k's
    projection), its KV-shared layers none (they read their source layer's pages)."""
    if arch.kv_sources and arch.kv_sources[i] != i:
        return []
    if arch.gemma4 is not None and arch.gemma4.k_eq_v and arch.layer_types[i] == "full":
        return [d]
    return [d, arch.v_head_dim or d]


def layer_q_heads(arch: Architecture, i: int) -> int:
    """Query heads of attention layer i: sliding_num_heads on a sliding layer when set (step3p7), else num_heads."""
    sliding = arch.layer_types and arch.layer_types[i] == "sliding"
    return arch.sliding_num_heads if sliding and arch.sliding_num_heads else arch.num_heads


def _shard_indexer(t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """minimax_m3's lightning indexer qk rows [index queries (Ni*Di), the index key (Di)]: this rank's index heads'
    query rows and the one key whole (every index head scores against it; each rank pages it beside its K/V).

    NOTE: split, not replicated: index head h chooses the blocks of query heads h*G .. (h+1)*G - 1 only (G =
    num_heads / Ni; helios.layers.msa.SparseAttention), and its scores read nothing but its own query and the shared
    key, so a rank's contiguous query heads need just the index heads they read, computed as on one rank. With fewer
    index heads than ranks (world_size a multiple of them) a rank's query heads lie in one head's group: that head,
    replicated (kv_heads_per_rank, as the KV heads of the real config: 4 index heads = 4 KV heads over 64 q heads)."""
    m = arch.msa
    return torch.cat([_kv_rows(t, 0, m.num_heads, m.head_dim, tp), t[m.num_heads * m.head_dim :]])


def _shard_gated_delta(key: str, name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """A gated delta rule layer's column-parallel tensors (helios.layers.linear_attention.GatedDeltaNet's layout):
    in_proj rows [q, k (Hk*dk each), v, z (Hv*dv each), b, a (Hv each)], conv rows [q, k, v] (its channels), dt_bias
    and A_log [Hv]: each block cut by head, so every rank holds the same key heads in q, k and its value heads."""
    r = arch.recurrent
    key_dim, value_dim = r.num_key_heads * r.key_head_dim, r.num_heads * r.value_head_dim
    if key == "linear.in_proj.weight":
        return _blocks(t, [key_dim, key_dim, value_dim, value_dim, r.num_heads, r.num_heads], tp)
    if key == "linear.conv.weight":
        return _blocks(t, [key_dim, key_dim, value_dim], tp)
    if key in ("linear.dt_bias", "linear.A_log"):
        return _blocks(t, [r.num_heads], tp)
    raise ValueError(f"no tensor-parallel rule for core tensor {name}")


def _shard_mamba(key: str, name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """A Mamba-2 mixer's column-parallel tensors (helios.layers.mamba.Mamba2Mixer's layout): in_proj rows [z, x
    (I = Hm*P each), B, C (G*N each), dt (Hm)], the conv's channels (and bias) [x, B, C], dt_bias, A_log, D [Hm] and
    the gated norm's weight [I]: each block cut by head or group, so a rank's x heads, the B/C groups they read, their
    gates and their norm groups are the same heads in every tensor."""
    r = arch.recurrent
    inner, groups = r.num_heads * r.value_head_dim, r.num_key_heads * r.key_head_dim
    if key == "mamba.in_proj.weight":
        return _blocks(t, [inner, inner, groups, groups, r.num_heads], tp)
    if key in ("mamba.conv.weight", "mamba.conv.bias"):
        return _blocks(t, [inner, groups, groups], tp)
    if key in ("mamba.dt_bias", "mamba.A_log", "mamba.D", "mamba.norm.weight"):
        return _blocks(t, [t.shape[0]], tp)
    raise ValueError(f"no tensor-parallel rule for core tensor {name}")


def _shard_kda(key: str, name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """Kimi delta attention's column-parallel tensors (helios.layers.kda.KimiDeltaAttention's layout) cut by head as
    the gated delta rule's: in_proj rows [q, k, v (H*d each), f_a, g_a (d each), b (H)] with q, k, v and b by head
    and the low-rank gate inputs f_a, g_a whole (every head's f_b / g_b rows read all d of them), the conv's q, k, v
    channels, f_b / g_b rows and dt_bias [H*d] by head, A_log [H]. The per-head output norm is replicated."""
    r = arch.recurrent
    inner, d = r.num_heads * r.key_head_dim, r.key_head_dim
    if key == "kda.in_proj.weight":
        if t.shape[0] != 3 * inner + 2 * d + r.num_heads:
            raise ValueError(f"{name}: {t.shape[0]} rows, not KDA's {3 * inner + 2 * d + r.num_heads}")
        return torch.cat([_blocks(t[: 3 * inner], [inner] * 3, tp), t[3 * inner : 3 * inner + 2 * d],
                          _blocks(t[3 * inner + 2 * d :], [r.num_heads], tp)])
    if key == "kda.conv.weight":
        return _blocks(t, [inner] * 3, tp)
    if key in ("kda.f_b.weight", "kda.g_b.weight", "kda.dt_bias", "kda.A_log"):
        return _blocks(t, [t.shape[0]], tp)
    raise ValueError(f"no tensor-parallel rule for core tensor {name}")


def _shard_mla(key: str, name: str, t: torch.Tensor, arch: Architecture, tp: TensorGroup) -> torch.Tensor:
    """Multi-head latent attention's column-parallel tensors (helios.layers.mla.MlaAttention's layout) by head:
    in_proj rows [q (Nq*(dn + dr)) or the q latent (Rq), the kv latent (R), the rope key (dr)] with q's rows split by
    head and the latents and the rope key whole (every rank writes the same latent pages: each head up-projects the
    whole latent), q_b's rows [Nq*(dn + dr)] and kv_b's [Nq*(dn + dv)] by head; the latents' norms replicated."""
    m, nq = arch.mla, arch.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if key == "mla.in_proj.weight":
        if m.q_lora_rank is not None:  # the q latent: every rank's q_b reads all of it
            return t
        return torch.cat([_blocks(t[: nq * qk], [nq * qk], tp), t[nq * qk :]])
    if key == "mla.q_b.weight":
        return _blocks(t, [nq * qk], tp)
    if key == "mla.kv_b.weight":
        return _blocks(t, [nq * (m.qk_nope_head_dim + m.v_head_dim)], tp)
    raise ValueError(f"no tensor-parallel rule for core tensor {name}")


def _blocks(t: torch.Tensor, sizes: list[int], tp: TensorGroup) -> torch.Tensor:
    """This rank's share of each block of rows (`sizes`, one after another from row 0), side by side (one block:
    a view; several: a copy)."""
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"a tensor of {t.shape[0]} rows does not hold the blocks {sizes}")
    parts, offset = [], 0
    for size in sizes:
        start, end = tp.split(size, "rows")
        parts.append(t[offset + start : offset + end])
        offset += size
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rank_runner(core, tp: TensorGroup, num_pages: int | None, page_size: int | None = None,
                **kwargs) -> ModelRunner:
    """A ModelRunner over this rank's shard of a loaded core (helios.core.load.LoadedCore); kwargs go to the
    constructor. NOTE: the core's precompiled kernels are for the whole model's shapes: none are installed."""
    m = core.manifest
    kwargs.setdefault("max_model_len", m.limits.context_length)
    return ModelRunner(shard_arch(m.arch, tp), shard_tensors(m.arch, core.tensors, tp), num_pages,
                       page_size or m.graph_plan.page_size, tp=tp, **kwargs)


# --- the step across ranks ------------------------------------------------------------------------------------------


class PlanChannel:
    """Rank 0's plans to the other ranks: a length, then the plan's msgpack bytes, two broadcasts over the control
    group. A length of 0 (no plan encodes to nothing) tells the workers to stop."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    def send(self, plan: SchedulerOutput | None) -> None:
        payload = b"" if plan is None else self._encoder.encode(plan)
        self._broadcast(torch.tensor([len(payload)], dtype=torch.int64))
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def receive(self) -> SchedulerOutput | None:
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        if not int(length):
            return None
        payload = torch.empty(int(length), dtype=torch.uint8)
        self._broadcast(payload)
        return self._decoder.decode(payload.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.ranks.control)


class TensorParallelRunner:
    """Rank 0's runner: each plan goes to the workers, then through its own shard's runner (which samples from the
    gathered logits). Everything else (stats, num_pages, startup, ...) is the shard runner's. `workers`: the
    worker processes it started (start_tensor_parallel), joined at close, which then leaves the group too."""

    def __init__(self, runner: ModelRunner, ranks: Ranks, workers: list = ()):
        if not ranks.is_driver:
            raise ValueError("only rank 0 drives; the other ranks run worker_loop")
        self.runner = runner
        self.channel = PlanChannel(ranks)
        self.workers = list(workers)
        self.is_closed = False

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        # a worker process that died would leave this rank waiting at the next collective: fail the engine instead
        dead = next((w for w in self.workers if not w.is_alive()), None)
        if dead is not None:
            raise RuntimeError(f"tensor-parallel worker {dead.name} exited (code {dead.exitcode})")
        self.channel.send(plan)
        return self.runner.execute(plan)

    def forward_logits(self, token_ids: list[int], chunk_size: int | None = None):
        # NOTE: forward_logits is no plan: every rank must call it at once (tests do), else rank 0 waits forever
        raise NotImplementedError("forward_logits under tensor parallelism runs on every rank at once, not through "
                                  "rank 0's runner alone")

    def close(self, timeout: float = 30.0) -> None:
        """Tell the workers to leave their loops (once); with worker processes of its own, join them (killing one
        that has not left after `timeout` seconds) and leave the group."""
        if self.is_closed:
            return
        self.is_closed = True
        self.channel.send(None)
        for worker in self.workers:
            worker.join(timeout)
            if worker.is_alive():
                worker.kill()
        if self.workers:
            dist.destroy_process_group()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def worker_loop(runner: ModelRunner, ranks: Ranks) -> int:
    """A worker rank's life after loading: run every plan rank 0 broadcasts on this rank's shard, until it says
    stop; returns the number of plans run."""
    channel = PlanChannel(ranks)
    num_plans = 0
    while (plan := channel.receive()) is not None:
        runner.execute_shard(plan)
        num_plans += 1
    return num_plans


def start_tensor_parallel(core, world_size: int, device: str, num_pages: int | None, page_size: int | None = None,
                          **runner_kwargs) -> TensorParallelRunner:
    """Rank 0 in this process and ranks 1 .. world_size - 1 in worker processes started here (spawned: a fresh
    interpreter, no CUDA state inherited; NVLink multicast off in their environment), meeting on a free port of
    127.0.0.1. Each maps the core and builds its shard's runner with the same arguments. Returns rank 0's runner;
    its close() stops and joins the workers. A failure here kills the workers it started."""
    multicast_off()
    port = free_port()
    args = dict(runner_kwargs, num_pages=num_pages, page_size=page_size)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=worker_main, name=f"helios-rank{rank}", daemon=True,
                               args=(rank, world_size, "127.0.0.1", port, str(core.path), device, args))
               for rank in range(1, world_size)]
    for worker in workers:
        worker.start()
    try:
        ranks = init_ranks(0, world_size, "127.0.0.1", port, device)
        runner = rank_runner(core, ranks.tp, device=device, **args)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return TensorParallelRunner(runner, ranks, workers)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(rank: int, world_size: int, address: str, port: int, core_path: str, device: str,
                runner_kwargs: dict) -> None:
    """A worker process (ranks 1 ..): join the group, load this rank's shard of the core, run plans until rank 0
    closes. runner_kwargs: what rank 0's rank_runner got (the same KV pool, so every rank holds the same pages)."""
    from helios.core.load import load_core

    ranks = init_ranks(rank, world_size, address, port, device)
    try:
        runner = rank_runner(load_core(core_path, verify_digests=False), ranks.tp, device=device, **runner_kwargs)
        worker_loop(runner, ranks)
    finally:
        dist.destroy_process_group()
