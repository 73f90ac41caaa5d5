"""Where a thread's time goes, by sampling its stack: `helios serve --engine-samples FILE` samples the engine
thread (the step loop) every few milliseconds and writes, at exit, the functions it was found in: by self samples
(the innermost frame) and by inclusive samples (anywhere on the stack), each as a share of all samples.

A statistical profile, not cProfile's: the sampling thread takes the GIL ~200 times a second for a few tens of
microseconds, so the step loop runs at its own speed (cProfile's hooks would slow every Python call of a loop that
is host-bound). Time in C code that holds the GIL shows as its Python caller; time waiting (a condition, a GPU
synchronization inside a torch call) as the call that waits. Standard library only.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter


def _label(code) -> str:
    return f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


class StackSampler:
    """Samples thread `thread_id`'s stack every `interval` seconds on a daemon thread until stop()."""

    def __init__(self, thread_id: int, interval: float = 0.005) -> None:
        self.thread_id = thread_id
        self.interval = interval
        self.num_samples = 0
        self.self_counts: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="helios-stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample of the thread's stack (nothing when the thread is gone)."""
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return
        self.num_samples += 1
        self.self_counts[_label(frame.f_code)] += 1
        seen = set()
        while frame is not None:
            label = _label(frame.f_code)
            if label not in seen:
                seen.add(label)
                self.inclusive[label] += 1
            frame = frame.f_back

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 40) -> str:
        """The top functions by self and by inclusive samples, as percentages of all samples."""
        n = max(self.num_samples, 1)
        lines = [f"{self.num_samples} samples every {1e3 * self.interval:.1f} ms"]
        for title, counts in (("self", self.self_counts), ("inclusive", self.inclusive)):
            lines.append(f"-- by {title} samples")
            lines += [f"{100 * c / n:6.1f}%  {label}" for label, c in counts.most_common(top)]
        return "\n".join(lines) + "\n"
