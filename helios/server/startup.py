"""The start-up timeline of `helios serve`: when each step ended, in seconds from this process's own start.

The origin is the process's start as the kernel recorded it (Linux /proc), so the interpreter's start and the
CLI's imports count too; where /proc cannot say, the Timeline's creation. `ready_line` prints that split and the
load's own (Runtime.timings); benchmarks/gpu_serve_start.py reads it. Standard library only: the CLI imports it
first, and the engine process prints the ready line without importing the app's protocol modules.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helios.server.runtime import Runtime

# the steps of the engine process with the ready line's name for the time each took (since the step before it)
STEPS = (("cli", "python and CLI"), ("checks", "checks"), ("compose", "compose imports"),
         ("spawn", "HTTP spawn"), ("imports", "torch imports"), ("load", "load"), ("warmup", "warm-up"),
         ("http", "HTTP wait"))


def process_age() -> float | None:
    """Seconds since this process started (fork or exec: the kernel's start time, 10 ms ticks); None off Linux
    or when /proc gives nothing sensible."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # NOTE: field 22 (starttime, clock ticks since boot); the command name before it may hold spaces
        start_ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0.0 <= age < 3600.0 else None


class Timeline:
    """Marks of the start-up steps: `mark(step)` records when a step ended, as seconds from the process start."""

    def __init__(self) -> None:
        age = process_age()
        self.origin = time.monotonic() - (age if age is not None else 0.0)
        self.at: dict[str, float] = {}

    def now(self) -> float:
        """Seconds since the process started."""
        return time.monotonic() - self.origin

    def mark(self, step: str) -> float:
        self.at[step] = self.now()
        return self.at[step]

    def durations(self) -> list[tuple[str, float]]:
        """(name, seconds) of each marked step in the order they ended: the time since the one before it."""
        names = dict(STEPS)
        out, previous = [], 0.0
        for at, step in sorted((at, step) for step, at in self.at.items() if step in names):
            out.append((names[step], at - previous))
            previous = at
        return out

    def describe(self) -> str:
        """`2.41s from process start (python and CLI 0.10s, checks 0.02s, ...; HTTP up at 1.90s)`."""
        if not self.at:
            return ""
        end = max(self.at.values())
        parts = ", ".join(f"{name} {s:.2f}s" for name, s in self.durations())
        up = f"; HTTP up at {self.at['http_up']:.2f}s" if "http_up" in self.at else ""
        return f"{end:.2f}s from process start ({parts}{up})"


def ready_line(rt: Runtime, announce: str | None, settings: str | None, started: str | None = None) -> str:
    """The start-up split (rt.timings) in one line, the URL it serves on and the execution switches; started:
    the process's own split (Timeline.describe), first."""
    t = rt.timings
    later = (f", {int(t.get('pending_graphs', 0))} more ({int(t['pending'])} buckets) left to capture in the "
             f"background" if t.get("pending") else "")
    side = (f"{'tokenizer, templates and ' if rt.tokenizer is not None else ''}grammar vocabulary "
            f"{t['side']:.2f}s beside the runner ({t.get('side_wait', 0.0):.2f}s after it), " if "side" in t else "")
    split = (f"open {t.get('open', 0.0):.2f}s, {side}weights {t.get('weights', 0.0):.2f}s, "
             f"kernel load {t.get('kernels', 0.0):.2f}s beside the weights ({t.get('kernels_wait', 0.0):.2f}s "
             f"after them{': ' + rt.kernels if rt.kernels else ''}), KV {t.get('kv', 0.0):.2f}s, "
             f"capture {t.get('capture', 0.0):.2f}s ({int(t.get('graphs', 0))} graphs{later}, "
             f"{int(t.get('kernels_jit', 0))} kernels compiled), digests {t.get('verify', 0.0):.2f}s more")
    return (f"helios: {rt.serving.model_id} ready: {started + '; ' if started else ''}"
            f"load {t.get('load', 0.0):.2f}s ({split}), "
            f"warm-up {t.get('warmup', 0.0):.2f}s{' on ' + announce if announce else ''}"
            f"{'; ' + settings if settings else ''}")
