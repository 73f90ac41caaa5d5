"""helios.engine.stack_samples: the sampler finds a busy thread in the function it spends its time in."""

from __future__ import annotations

import threading
import time

from helios.engine.stack_samples import StackSampler


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _idle_here(stop: threading.Event) -> None:
    stop.wait()


def test_samples_name_the_function_a_thread_is_in():
    stop = threading.Event()
    worker = threading.Thread(target=lambda: (_spin_here(stop)))
    worker.start()
    try:
        sampler = StackSampler(worker.ident, interval=0.002).start()
        time.sleep(0.3)
        sampler.stop()
    finally:
        stop.set()
        worker.join()
    assert sampler.num_samples > 20
    top_inclusive = sampler.inclusive.most_common(3)
    assert any(label.startswith("_spin_here (") for label, _ in top_inclusive)
    assert not any(label.startswith("_idle_here") for label in sampler.inclusive)
    report = sampler.report()
    assert "-- by self samples" in report and "_spin_here (test_stack_samples.py:" in report


def test_a_finished_thread_gives_no_samples():
    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    sampler = StackSampler(worker.ident)
    sampler.sample()
    assert sampler.num_samples == 0 and sampler.report().startswith("0 samples")
