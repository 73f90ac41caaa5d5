"""The ahead-of-time kernel command line and the manifest side of helios.kernels.aot.

`python -m helios.runner.aot_compile compile --manifest core.toml --target cuda-sm90 --out DIR` is what ignition's
kernel precompile runs in a subprocess (ignition/prepare/kernels.py); it decodes the manifest here, so that the
kernels package never imports helios.core (it takes the manifest as data). A family whose launches
helios.kernels.aot_shapes does not list (hybrid, MoE and the newer attention families) adds its decode graphs'
kernels, found by running them on meta tensors (helios.runner.aot_trace). Imports helios.core.manifest,
helios.kernels.aot and helios.runner.aot_trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helios.core.manifest import MANIFEST_FILE, decode_manifest
from helios.kernels import aot
from helios.runner.aot_trace import decode_tracer


def read_manifest(core_dir: Path | str):
    """The decoded manifest of the core at core_dir."""
    return decode_manifest((Path(core_dir) / MANIFEST_FILE).read_bytes())


def load_offline(core_dir: Path, cache_root: Path) -> tuple[int, int]:
    """helios.kernels.aot.load_offline for the core at core_dir (no GPU needed)."""
    manifest = read_manifest(core_dir)
    arch = aot.parse_target(manifest.kernels[0].target)
    trace = decode_tracer(manifest, major=arch // 10, num_sms=aot.TARGET_SMS.get(arch, 132))
    return aot.load_offline(core_dir, manifest, cache_root, trace=trace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helios.runner.aot_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a core's kernels for a GPU target")
    comp.add_argument("--manifest", type=Path, required=True, help="core.toml to compile for")
    comp.add_argument("--target", required=True, help="cuda-sm<NN>")
    comp.add_argument("--out", type=Path, required=True, help="directory to write kernels into")
    args = parser.parse_args(argv)
    manifest = decode_manifest(args.manifest.read_bytes())
    arch = aot.parse_target(args.target)
    num_sms = aot.TARGET_SMS.get(arch, 132)
    shape = aot.shape_from_manifest(manifest, num_sms)
    trace = decode_tracer(manifest, major=arch // 10, num_sms=num_sms)
    index = aot.compile_kernels(shape, args.target, args.out, trace=trace)
    print(json.dumps({"kernels": len(index["kernels"]), "triton_version": index["triton_version"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
