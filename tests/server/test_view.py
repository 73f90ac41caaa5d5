"""helios.server.view (rate history, figures, sparklines, the frame) and `helios top` against real servers."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading

import httpx
import msgspec
import pytest
from rich.console import Console

from helios.server.metrics import FirstResponse, Snapshot, render_json
from helios.server.view import BLOCKS, RateHistory, is_reset, render_frame, sparkline
from tests.server.conftest import HELIOS, ROOT, _free_port

LABELS = ("DECODE", "PREFILL", "REQUESTS", "FAILED", "WEIGHTS", "DEPTH", "ACCEPT", "REUSE", "ACTIVE", "PENDING",
          "KV PAGES", "CACHED", "ADMISSION", "FIRST RESPONSE", "UPTIME", "LAUNCHES", "decode tok/s", "prefill tok/s")


def snap(**fields) -> Snapshot:
    return Snapshot(**fields)


def frame_text(history: RateHistory, error: str | None = None) -> str:
    console = Console(record=True, width=120)
    console.print(render_frame(history, "http://test:1", error))
    return console.export_text()


def test_rates_over_the_window():
    h = RateHistory(window_s=60)
    h.add(10.0, snap(prefill_tokens=100, generated_tokens=50, completed=1, failed=2, reused_tokens=16))
    h.add(12.0, snap(prefill_tokens=300, generated_tokens=250, completed=3, failed=3, reused_tokens=48))
    h.add(14.0, snap(prefill_tokens=500, generated_tokens=450, completed=5, failed=3, reused_tokens=64))
    f = h.figures()
    assert f.span_s == 4.0 and f.num_samples == 3
    assert f.prefill_tok_s == 100.0 and f.decode_tok_s == 100.0
    assert f.completed_per_s == 1.0
    assert (f.failed, f.failed_in_window) == (3, 1)
    assert f.reused_tokens == 48
    assert h.rate_series("generated_tokens") == [100.0, 100.0]


def test_one_sample_has_gauges_but_no_rates():
    h = RateHistory()
    h.add(1.0, snap(active=2, pending=1, free_pages=300, total_pages=400, cached_pages=7, http_admission_slots=64,
                    http_admission_in_use=5, uptime_seconds=3725, first_response=FirstResponse(median_seconds=0.25)))
    f = h.figures()
    assert f.decode_tok_s is None and f.prefill_tok_s is None and f.depth is None and f.weights_bytes_s is None
    assert (f.active, f.pending, f.free_pages, f.total_pages, f.cached_pages) == (2, 1, 300, 400, 7)
    assert f.used_pages_pct == 25.0
    assert (f.admission_in_use, f.admission_slots) == (5, 64)
    assert f.first_response_s == 0.25 and f.uptime_s == 3725
    assert RateHistory().figures().num_samples == 0


def test_weights_is_bytes_per_step_times_verify_steps_per_second():
    h = RateHistory()
    h.add(0.0, snap(decode_weight_bytes=270_000_000, verify_steps=100))
    h.add(2.0, snap(decode_weight_bytes=270_000_000, verify_steps=300))
    assert h.figures().weights_bytes_s == 270_000_000 * 100
    assert "27.00 GB/s" in frame_text(h)
    undeclared = RateHistory()
    undeclared.add(0.0, snap(verify_steps=1))
    undeclared.add(1.0, snap(verify_steps=9))
    assert undeclared.figures().weights_bytes_s is None
    assert "n/a" in frame_text(undeclared)


def test_depth_and_acceptance():
    h = RateHistory()
    h.add(0.0, snap(verification_drafts=10, verification_rounds=10, accepted_drafts=5))
    h.add(1.0, snap(verification_drafts=10, verification_rounds=10, accepted_drafts=5))
    f = h.figures()
    assert f.depth is None and f.acceptance is None  # no rounds, no drafts in the window
    h.add(2.0, snap(verification_drafts=40, verification_rounds=30, accepted_drafts=20))
    f = h.figures()
    assert f.depth == pytest.approx(30 / 20)  # zero-draft rounds count in the denominator
    assert f.acceptance == pytest.approx(15 / 30)
    h2 = RateHistory()
    h2.add(0.0, snap(verification_rounds=5))
    h2.add(1.0, snap(verification_rounds=9))
    assert h2.figures().depth == 0.0 and h2.figures().acceptance is None


def test_graph_launches_per_second_by_kind():
    h = RateHistory()
    h.add(0.0, snap(graph_launches={"graph": 10}))
    h.add(2.0, snap(graph_launches={"graph": 30, "eager": 4}))
    assert h.figures().launches_per_s == {"eager": 2.0, "graph": 10.0}


def test_counter_reset_restarts_the_history():
    h = RateHistory()
    assert not h.add(0.0, snap(generated_tokens=1000, uptime_seconds=500))
    assert not h.add(1.0, snap(generated_tokens=1100, uptime_seconds=501))
    assert h.add(2.0, snap(generated_tokens=20, uptime_seconds=0))  # the server restarted
    assert len(h.samples) == 1 and h.num_restarts == 1
    assert h.figures().decode_tok_s is None
    h.add(3.0, snap(generated_tokens=70, uptime_seconds=1))
    assert h.figures().decode_tok_s == 50.0
    assert "restarted" in frame_text(h)


def test_reset_is_any_total_going_down():
    assert is_reset(snap(failed=3), snap(failed=2))
    assert is_reset(snap(graph_launches={"graph": 5}), snap(graph_launches={}))
    assert not is_reset(snap(active=3, free_pages=10), snap(active=0, free_pages=2))  # gauges may fall


def test_window_trims_old_samples_but_keeps_two():
    h = RateHistory(window_s=10)
    for t in range(0, 31):
        h.add(float(t), snap(generated_tokens=t * t))
    assert [t for t, _ in h.samples] == [float(t) for t in range(20, 31)]
    assert h.figures().span_s == 10.0
    assert h.figures().decode_tok_s == (30 * 30 - 20 * 20) / 10
    slow = RateHistory(window_s=10)
    slow.add(0.0, snap(generated_tokens=0))
    slow.add(100.0, snap(generated_tokens=500))  # polled slower than the window: still one rate
    assert slow.figures().decode_tok_s == 5.0
    bounded = RateHistory(window_s=1000, max_samples=5)
    for t in range(20):
        bounded.add(float(t), snap())
    assert len(bounded.samples) == 5


def test_time_must_advance():
    h = RateHistory()
    h.add(1.0, snap())
    with pytest.raises(ValueError):
        h.add(1.0, snap())


def test_sparkline():
    line = sparkline([0, 1, 2, 4, 8], width=12)
    assert len(line) == 12 and line.startswith(" " * 7)
    assert line[7:] == BLOCKS[0] + BLOCKS[1] + BLOCKS[2] + BLOCKS[4] + BLOCKS[-1]
    assert set(sparkline([0.0, 0.0], width=3)) <= {" ", BLOCKS[0]}
    assert sparkline([], width=4) == "    "
    long = sparkline([float(i) for i in range(100)], width=10)
    assert len(long) == 10 and long[-1] == BLOCKS[-1] and " " not in long
    assert set(sparkline([0.001, 1000.0], width=2)) == {BLOCKS[1], BLOCKS[-1]}  # a trickle stays visible


def test_frame_shows_every_label_and_the_error():
    h = RateHistory()
    for t in range(5):
        h.add(float(t), snap(generated_tokens=100 * t, prefill_tokens=1000 * t, total_pages=100, free_pages=60,
                             uptime_seconds=3600 + t))
    text = frame_text(h, error="cannot reach http://test:1/metrics?format=json")
    for label in LABELS:
        assert label in text, label
    assert "100.0 tok/s" in text and "1,000.0 tok/s" in text and "40/100 used (40%)" in text
    assert "1:00:04" in text and "error: cannot reach" in text
    assert any(c in text for c in BLOCKS)
    assert "error" not in frame_text(RateHistory())  # an empty history renders too


def test_narrow_frame_has_one_pair_a_row_and_whole_labels():
    h = RateHistory()
    h.add(0.0, snap(total_pages=10, free_pages=10))
    h.add(1.0, snap(generated_tokens=5, total_pages=10, free_pages=10))
    console = Console(record=True, width=50)
    console.print(render_frame(h, "http://test:1", width=50))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 50 for line in lines)
    for label in LABELS:
        assert any(line.startswith(label) for line in lines), label
    assert any(line.startswith("decode tok/s") and line.rstrip().endswith("max 5.0") for line in lines)


def run_top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`helios top --once ARGS` with its output piped, so rich lays it out for its default 80 columns."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([str(HELIOS), "top", "--once", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def test_top_once_unreachable_is_one_line_and_exit_1():
    out = run_top("--interval", "0.1", f"http://127.0.0.1:{_free_port()}")
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("helios top: cannot reach"), out.stderr
    assert "Traceback" not in out.stderr


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b"<html>not metrics</html>"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def html_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_top_once_non_json_answer_is_one_line_and_exit_1(html_server):
    out = run_top("--interval", "0.1", html_server)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a helios metrics object" in lines[0], out.stderr


def test_snapshot_round_trip_feeds_the_history():
    # what `helios top` decodes is what the server encodes; unknown extra fields are ignored
    body = render_json(snap(generated_tokens=7, graph_launches={"graph": 2}))
    extra = body[:-1] + b',"input_decoded_images_total":3}'
    assert msgspec.json.decode(extra, type=Snapshot).generated_tokens == 7


def test_top_once_against_a_real_server(server):
    r = httpx.post(server.base_url + "/completions", headers=server.headers(), timeout=120,
                   json={"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200, r.text
    out = run_top("--interval", "0.5", server.url, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    for label in LABELS:
        assert label in out.stdout, (label, out.stdout)
    assert "helios top " + server.url in out.stdout
    assert all(len(line) <= 80 for line in out.stdout.splitlines())
    decode = next(line for line in out.stdout.splitlines() if line.startswith("DECODE"))
    assert "tok/s" in decode  # two samples half a second apart: a rate, not "-"
