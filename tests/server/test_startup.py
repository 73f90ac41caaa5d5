"""The start-up timeline and the ready line: its split in the order the steps ran, and
benchmarks/gpu_serve_start.py's parser reading back every figure the line prints (the GPU run depends on it)."""

from __future__ import annotations

from benchmarks.gpu_serve_start import parse_ready
from helios.server.startup import Timeline, process_age, ready_line


def test_process_age_reads_this_process():
    age = process_age()
    assert age is not None and age >= 0.0  # Linux: /proc gives the start time


def test_durations_follow_the_order_steps_ended():
    timeline = Timeline()
    timeline.at.update(cli=0.10, checks=0.15, spawn=0.20, imports=1.20, load=2.50, warmup=2.60, http=2.62,
                       http_up=1.90)
    names = [name for name, _ in timeline.durations()]
    assert names == ["python and CLI", "checks", "HTTP spawn", "torch imports", "load", "warm-up", "HTTP wait"]
    assert [round(s, 2) for _, s in timeline.durations()] == [0.10, 0.05, 0.05, 1.00, 1.30, 0.10, 0.02]
    assert timeline.describe().startswith("2.62s from process start (python and CLI 0.10s, checks 0.05s")
    assert timeline.describe().endswith("; HTTP up at 1.90s)")


def test_the_benchmark_parses_the_ready_line(core_runtime):
    timeline = Timeline()
    timeline.at.update(cli=0.11, checks=0.16, compose=0.18, spawn=0.19, imports=1.43, load=5.61, warmup=5.90,
                       http=5.91, http_up=2.75)
    core_runtime.timings.update(load=4.18, open=0.06, side=0.81, side_wait=0.0, weights=3.25, kernels=3.18,
                                kernels_wait=0.03, kv=0.04, capture=0.31, graphs=4, pending=11, pending_graphs=22,
                                kernels_jit=0, verify=0.0, warmup=0.29)
    try:
        line = ready_line(core_runtime, "http://127.0.0.1:8000", "4 HTTP processes", timeline.describe())
    finally:
        core_runtime.timings.clear()
    assert " ready: 5.91s from process start (" in line and "22 more (11 buckets) left to capture" in line
    split = parse_ready(line)
    assert split["ready"] == 5.91 and split["http_up"] == 2.75
    steps = [k for k in split if not k.startswith("load_") and k not in ("ready", "http_up")]
    assert steps == ["python and CLI", "checks", "compose imports", "HTTP spawn", "torch imports", "load",
                     "warm-up", "HTTP wait"]
    assert split["torch imports"] == 1.24 and split["load"] == 4.18
    assert {k: split[k] for k in split if k.startswith("load_")} == {
        "load_open": 0.06, "load_beside": 0.81, "load_weights": 3.25, "load_kernels": 3.18, "load_kv": 0.04,
        "load_capture": 0.31, "load_graphs": 4, "load_background": 22}
    assert parse_ready("helios: m ready: load 1.00s (open 0.10s, ...)") == {}  # a line without the timeline
