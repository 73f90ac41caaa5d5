"""flash-linear-attention's autotuned kernels, tuned once and carried: the configs its Triton autotuners chose on a
device, written out as data and put back into their caches before the first prefill, so a fresh machine runs fla's
chunked prefill without benchmarking every config of every kernel first (minutes for a hybrid family's shapes on an
H200; a serve's first prompt would wait for it).

`snapshot()` reads the loaded autotuners' caches (kernel, key, chosen config); `seed(entries)` puts such entries back
into the autotuners of the same kernels. A key holds the kernel's shape constants (heads, head dims, chunk size, ...)
and its tensors' dtypes, so an entry applies exactly where the tuning run saw that shape and dtype; any other shape
autotunes as before. Tables live beside this module as `fla_<device>.json` (`table_for`), made on the device by
`benchmarks/gpu_hybrid.py --dump-fla`: a table is only as good as the device it was measured on, so it is chosen by
the device's name. Triton's own disk cache (fla asks for cache_results) still keeps what a machine tunes itself.

Imports nothing heavy: triton (and fla's modules) only inside the functions.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TABLES = Path(__file__).resolve().parent
CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def autotuners() -> dict[str, object]:
    """The loaded fla modules' Triton autotuners by kernel name (module.qualname of the JIT function), found behind
    their heuristics wrappers. Only fla's: helios' own kernels are compiled ahead of time, not autotuned."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            while issubclass(type(value), KernelInterface) and not isinstance(value, Autotuner):
                value = getattr(value, "fn", None)
            if isinstance(value, Autotuner):
                fn = value.fn
                while not hasattr(fn, "__qualname__") and hasattr(fn, "fn"):
                    fn = fn.fn
                found[f"{getattr(fn, '__module__', name)}.{getattr(fn, '__qualname__', '?')}"] = value
    return found


def _config_dict(config) -> dict:
    return {"kwargs": dict(config.kwargs),
            **{f: getattr(config, f) for f in CONFIG_FIELDS if getattr(config, f, None) is not None}}


def _config(entry: dict):
    import triton

    known = {f: entry[f] for f in CONFIG_FIELDS if f in entry}
    return triton.Config(dict(entry["kwargs"]), **known)


def snapshot() -> list[dict]:
    """Every loaded fla autotuner's cache: [{kernel, key, config}], sorted (the same caches give the same bytes)."""
    entries = []
    for kernel, tuner in autotuners().items():
        for key, config in tuner.cache.items():
            entries.append({"kernel": kernel, "key": list(key), "config": _config_dict(config)})
    return sorted(entries, key=lambda e: (e["kernel"], json.dumps(e["key"])))


def seed(entries: list[dict]) -> int:
    """Put `entries` into the caches of the loaded fla autotuners of the same kernels (a key the cache already holds
    keeps its own choice); entries whose kernel is not loaded or whose config names a parameter the kernel lacks
    are skipped. Returns how many went in."""
    tuners = autotuners()
    count = 0
    for entry in entries:
        tuner = tuners.get(entry["kernel"])
        if tuner is None:
            continue
        key = tuple(entry["key"])
        if key in tuner.cache:
            continue
        config = entry["config"]
        if not set(config["kwargs"]) <= set(tuner.arg_names):
            continue
        tuner.cache[key] = _config(config)
        count += 1
    return count


def device_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200': a table's file name part."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def table_for(device_name: str) -> list[dict]:
    """The entries tuned on a device of this name ([] when none was)."""
    path = TABLES / f"fla_{device_slug(device_name)}.json"
    return json.loads(path.read_text())["entries"] if path.is_file() else []


def dump(path: Path, device_name: str, versions: dict[str, str]) -> int:
    """Write snapshot() as a table for `device_name` (with the versions it was tuned under); returns its size."""
    entries = snapshot()
    Path(path).write_text(json.dumps({"device": device_name, "versions": versions, "entries": entries}, indent=1,
                                     sort_keys=True) + "\n")
    return len(entries)


def seed_for_device(device_name: str) -> int:
    """Import fla's prefill kernels (the gated delta rule's and KDA's chunked forms) and seed them from this
    device's table; 0 when there is no table or fla is not installed."""
    entries = table_for(device_name)
    if not entries:
        return 0
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return 0
    return seed(entries)
