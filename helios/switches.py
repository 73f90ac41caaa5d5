"""Execution switches: every HELIOS_* variable that changes how a model executes, declared once here.

Read from the environment once at start (`Switches.from_environ(os.environ)`, by the composition root or a
benchmark), validated (a bad value is one SwitchError naming the variable and what it accepts), then passed as
this frozen object: runner -> model -> layers, which hand kernel launchers plain values. Nothing below reads
the environment on a forward (STYLE.md rule 17). The defaults are the measured fast paths (benchmarks/RESULTS.md),
so a caller that passes nothing runs as a process with none of the variables set.
Pure Python: imports msgspec only (the server and the engine may import it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

GemvMode = Literal["narrow", "all", "square", "nowide", "off"]
L2Prefetch = Literal["off", "bulk", "load"]
MoePrefill = Literal["triton", "grouped"]
MoeDecode = Literal["dot", "gemv"]
EarlyUpload = Literal["pinned", "pageable", "off"]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class SwitchError(ValueError):
    """A HELIOS_* variable holds a value its switch does not accept."""


class Switch(msgspec.Struct, frozen=True):
    """The declaration of one switch: its variable, the Switches field it sets, its values and meaning."""

    env: str  # the environment variable
    field: str  # the Switches attribute
    kind: str  # "bool", "tristate" (unset / on / off), "choice" or "path"
    meaning: str
    choices: tuple[str, ...] = ()  # "choice": the accepted spellings (aliases in ALIASES)


# name, type, default (the Switches field's) and meaning of every switch; the order of describe()
DECLARED: tuple[Switch, ...] = (
    Switch("HELIOS_GEMV", "gemv", "choice",
           "which one-row 16-bit GPU projections take the Triton GEMV instead of cuBLAS: narrow (weights with no "
           "more rows than columns: o, down), all (also 1/on/true/yes), square (o), nowide (all but 4x-tall "
           "weights), off (also 0/false/no)",
           ("narrow", "all", "square", "nowide", "off")),
    Switch("HELIOS_PDL", "pdl", "tristate",
           "programmatic dependent launch of one-row kernels (sm90+): unset = only the norm-free batch-1 steps, "
           "where every kernel is ours; on = every one-row launch; off = none"),
    Switch("HELIOS_GEMV_PDL", "gemv_pdl", "bool",
           "off: the GEMV launches never start beside the kernel before them (benchmarks compare)"),
    Switch("HELIOS_ROPE_TABLE", "rope_table", "bool",
           "GPU: gather each step's rotary rows from the table made at load; off computes them each step"),
    Switch("HELIOS_DECODE_OVERLAP", "decode_overlap", "bool",
           "GPU: launch the next graphed decode step before the host has read this one's tokens (speculation); "
           "off never speculates, whatever the runner's argument"),
    Switch("HELIOS_PROMPT_GRAPHS", "prompt_graphs", "bool",
           "GPU dense families: steps of a few short prompt chunks (<= 8 sequences, <= 512 tokens) replay a CUDA "
           "graph per token bucket (runner/prompt_graphs.py); off runs them eagerly"),
    Switch("HELIOS_ONE_PASS", "one_pass", "bool",
           "GPU: a step that takes prompts beside up to 72 decodes runs as one prompt-graph replay (one pass over the "
           "weights) instead of the decode graph plus the prompt rows' pass; the scheduler holds new prompts back one "
           "step after a decode step so that step is not run ahead (runner/prompt_graphs.py); off: two passes"),
    Switch("HELIOS_FOLD_NORMS", "fold_norms", "bool",
           "GPU batch 1: the residual add and RMSNorm ride in the GEMV of the projection after them"),
    Switch("HELIOS_FUSED_DECODE", "fused_decode", "bool",
           "GPU decode: q/k norms, rotary, cache write and attention in one launch from the qkv row (decode_qkv); "
           "off runs rotary_cache then paged decode attention"),
    Switch("HELIOS_DEFER_NORMS", "defer_norms", "bool",
           "GPU 16-bit llama: norm weights folded into qkv / gate_up at load (runner/norm_folding.py) and batch-1 "
           "decode without norm kernels; off keeps the weights as bound and the norm kernels"),
    Switch("HELIOS_L2_PREFETCH", "l2_prefetch", "choice",
           "GPU batch 1: pull the o weight into L2 beside attention: off (also 0/false/no), bulk (Hopper bulk "
           "prefetch), load (discarded loads)",
           ("off", "bulk", "load")),
    Switch("HELIOS_MOE_PREFILL", "moe_prefill", "choice",
           "GPU MoE: the routed experts' GEMMs of prompt-sized batches (over 1024 token-expert entries): triton "
           "(fused_moe's grouped Triton GEMM, the activation in its epilogue) or grouped (torch._grouped_mm on sm90+, "
           "bf16, then the activation kernel)",
           ("triton", "grouped")),
    Switch("HELIOS_MOE_DECODE", "moe_decode", "choice",
           "GPU MoE, one token: the routed experts' GEMMs as dot (fused_moe's grouped GEMM, 16-row blocks) or gemv "
           "(fused_moe.expert_outputs_one_token: GEMV kernels over the token's experts, split-K)",
           ("dot", "gemv")),
    Switch("HELIOS_PINNED_UPLOAD", "pinned_upload", "bool",
           "GPU load: the weights go to the device through a ring of pinned staging buffers (helios.runner.upload) "
           "instead of one driver-staged copy per tensor (off: those copies; an 8B core's 16 GB took 0.57-0.65 s "
           "through the ring alone, 2.33-2.66 s without it, on the H100)"),
    Switch("HELIOS_EARLY_UPLOAD", "early_upload", "choice",
           "GPU serve: the weights' upload starts before torch is imported, through the CUDA driver API on threads "
           "beside the import (helios.runner.early_upload): pinned (a ring of pinned buffers), pageable (driver-staged "
           "copies) or off (the load's own upload, after the import; the default until a cold start measures a gain: "
           "beside the import its first version ran at 3-4 GB/s and slowed the import by as much as it saved)",
           ("pinned", "pageable", "off")),
    Switch("HELIOS_HOST_THREADS", "host_threads", "bool",
           "GPU serving: torch's intra-op thread pool for the engine's host-side tensors (a step's inputs); off "
           "runs them on one thread: the pool's workers only spin beside such small ops, on cores the HTTP "
           "processes need"),
    Switch("HELIOS_KERNEL_CACHE", "kernel_cache", "path",
           "the directory precompiled kernels are installed into at start (default: $XDG_CACHE_HOME or "
           "~/.cache, then helios/triton)"),
)

# accepted spellings of a choice -> the value
ALIASES = {
    "gemv": {**{v: "all" for v in _TRUE}, **{v: "off" for v in _FALSE}},
    "l2_prefetch": {v: "off" for v in _FALSE},
    "early_upload": {**{v: "pinned" for v in _TRUE}, **{v: "off" for v in _FALSE}},
}


class Switches(msgspec.Struct, frozen=True, kw_only=True):
    """The execution switches of one process (DECLARED says what each means); defaults = nothing set."""

    gemv: GemvMode = "narrow"
    pdl: bool | None = None  # None: only the norm-free batch-1 steps
    gemv_pdl: bool = True
    rope_table: bool = True
    decode_overlap: bool = True
    prompt_graphs: bool = True
    one_pass: bool = True
    fold_norms: bool = True
    fused_decode: bool = True
    defer_norms: bool = True
    l2_prefetch: L2Prefetch = "off"
    moe_prefill: MoePrefill = "triton"
    moe_decode: MoeDecode = "dot"
    pinned_upload: bool = True
    early_upload: EarlyUpload = "off"
    host_threads: bool = False
    kernel_cache: str | None = None  # None: the default directory (helios.kernels.aot.runtime_cache_root)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Switches:
        """The switches the HELIOS_* variables of `environ` set; unset or empty variables keep the default.
        Raises SwitchError on a value a switch does not accept."""
        values = {}
        for switch in DECLARED:
            raw = environ.get(switch.env, "").strip()
            if raw:
                values[switch.field] = _parse(switch, raw)
        return cls(**values)

    def describe(self) -> str:
        """One line for the ready line: every switch as name=value ("default" marks an unset path)."""
        parts = []
        for switch in DECLARED:
            value = getattr(self, switch.field)
            if switch.kind == "tristate":
                text = "norm-free" if value is None else _on_off(value)
            elif switch.kind == "bool":
                text = _on_off(value)
            elif switch.kind == "path":
                text = value or "default"
            else:
                text = value
            parts.append(f"{switch.field}={text}")
        return "switches: " + " ".join(parts)


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _parse(switch: Switch, raw: str):
    if switch.kind == "path":
        return raw
    value = raw.lower()
    if switch.kind in ("bool", "tristate"):
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        accepted = "/".join(_TRUE + _FALSE)
    else:
        value = ALIASES.get(switch.field, {}).get(value, value)
        if value in switch.choices:
            return value
        accepted = "/".join(dict.fromkeys(switch.choices + tuple(ALIASES.get(switch.field, {}))))
    raise SwitchError(f"{switch.env}={raw!r} is not a value it accepts ({accepted})")


DEFAULT_SWITCHES = Switches()
