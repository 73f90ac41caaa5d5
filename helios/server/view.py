"""The serving terminal dashboard's model: a rate history over /metrics Snapshots and one rendered frame.

`RateHistory` keeps (monotonic time, Snapshot) samples over a sampling window and derives the figures
(tok/s, WEIGHTS, DEPTH, acceptance, gauges); `render_frame` turns them into a rich renderable with sparklines.
Pure: no torch, no HTTP (`helios top` in cli.py polls the server and feeds this module).
"""

from __future__ import annotations

from collections import deque

from msgspec import Struct
from rich.console import Group
from rich.table import Table
from rich.text import Text

from helios.server.metrics import PROMETHEUS, Snapshot

WINDOW_S = 60.0
MAX_SAMPLES = 4096
PLOT_WIDTH = 60  # sparkline() cells by default; a frame fits its plots to the console (at most twice this)
PLOT_LABEL = len("prefill tok/s")
TWO_PAIRS_WIDTH = 72  # narrower consoles get one label/value pair a row
BLOCKS = "▁▂▃▄▅▆▇█"  # U+2581..U+2588, one per eighth of a cell

# Totals since server start: one of these going down means the server restarted (or was replaced).
COUNTERS = tuple(f for f, (_, kind, _) in PROMETHEUS.items() if kind == "counter") + ("draft_steps", "uptime_seconds")


class Figures(Struct, frozen=True, kw_only=True):
    """What one frame shows. Rates are per second over the window; None until two samples span time."""

    span_s: float = 0.0  # seconds between the oldest and newest sample in the window
    num_samples: int = 0
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    completed_per_s: float | None = None
    failed: int = 0  # total since server start
    failed_in_window: int = 0
    decode_weight_bytes: int = 0  # per decode step; zero when the core's recipe declares none
    weights_bytes_s: float | None = None  # decode_weight_bytes x verify steps/s; None when undeclared
    depth: float | None = None  # draft positions per request round; None without rounds in the window
    acceptance: float | None = None  # accepted / allocated drafts; None without drafts in the window
    reused_tokens: int = 0  # GPU prefix-cache tokens reused in the window
    active: int = 0
    pending: int = 0
    free_pages: int = 0
    total_pages: int = 0
    used_pages_pct: float | None = None
    cached_pages: int = 0
    admission_in_use: int = 0
    admission_slots: int = 0
    first_response_s: float | None = None
    uptime_s: int = 0
    launches_per_s: dict[str, float] = {}


def is_reset(prev: Snapshot, snap: Snapshot) -> bool:
    """True when any total went down: the server behind the URL restarted, so deltas across it mean nothing."""
    if any(getattr(snap, f) < getattr(prev, f) for f in COUNTERS):
        return True
    return any(snap.graph_launches.get(k, 0) < v for k, v in prev.graph_launches.items())


class RateHistory:
    """Samples of the last `window_s` seconds (always at most `max_samples`, and the newest two even when older)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES):
        if window_s <= 0 or max_samples < 2:
            raise ValueError("window_s must be positive and max_samples at least 2")
        self.window_s = window_s
        self.samples: deque[tuple[float, Snapshot]] = deque(maxlen=max_samples)
        self.num_restarts = 0

    def add(self, t: float, snap: Snapshot) -> bool:
        """Append a sample taken at monotonic time `t`; returns True when a counter reset restarted the history."""
        restarted = False
        if self.samples:
            prev_t, prev = self.samples[-1]
            if t <= prev_t:
                raise ValueError(f"sample time {t} is not after the previous one ({prev_t})")
            if is_reset(prev, snap):
                self.samples.clear()
                self.num_restarts += 1
                restarted = True
        self.samples.append((t, snap))
        horizon = t - self.window_s
        # NOTE: keep two samples even when the older one is past the horizon (a poll slower than the window,
        # or a server that was unreachable for a while): one rate over a longer span beats none.
        while len(self.samples) > 2 and self.samples[0][0] < horizon:
            self.samples.popleft()
        return restarted

    def rate_series(self, field: str) -> list[float]:
        """Per-interval rates of one counter between successive samples (oldest first), for the plots."""
        pairs = zip(list(self.samples), list(self.samples)[1:])
        return [(getattr(b, field) - getattr(a, field)) / (tb - ta) for (ta, a), (tb, b) in pairs]

    def figures(self) -> Figures:
        if not self.samples:
            return Figures()
        t0, first = self.samples[0]
        t1, last = self.samples[-1]
        fr = last.first_response
        gauges = dict(
            num_samples=len(self.samples), decode_weight_bytes=last.decode_weight_bytes, failed=last.failed,
            active=last.active, pending=last.pending,
            free_pages=last.free_pages, total_pages=last.total_pages, cached_pages=last.cached_pages,
            used_pages_pct=(100.0 * (last.total_pages - last.free_pages) / last.total_pages
                            if last.total_pages else None),
            admission_in_use=last.http_admission_in_use, admission_slots=last.http_admission_slots,
            first_response_s=fr.median_seconds, uptime_s=last.uptime_seconds,
        )
        dt = t1 - t0
        if dt <= 0:
            return Figures(**gauges)

        def delta(field: str) -> int:
            return getattr(last, field) - getattr(first, field)

        drafts, rounds = delta("verification_drafts"), delta("verification_rounds")
        weights = last.decode_weight_bytes * delta("verify_steps") / dt if last.decode_weight_bytes else None
        kinds = sorted(set(first.graph_launches) | set(last.graph_launches))
        launches = {k: (last.graph_launches.get(k, 0) - first.graph_launches.get(k, 0)) / dt for k in kinds}
        return Figures(
            **gauges, span_s=dt,
            prefill_tok_s=delta("prefill_tokens") / dt, decode_tok_s=delta("generated_tokens") / dt,
            completed_per_s=delta("completed") / dt, failed_in_window=delta("failed"), weights_bytes_s=weights,
            depth=drafts / rounds if rounds else None,
            acceptance=delta("accepted_drafts") / drafts if drafts else None,
            reused_tokens=delta("reused_tokens"), launches_per_s=launches,
        )


def sparkline(values: list[float], width: int = PLOT_WIDTH) -> str:
    """The last `width` values as block characters scaled to their maximum, left-padded with spaces to `width`.

    Zero is the lowest block; any positive value is at least the second, so a trickle stays visible."""
    values = values[-width:] if width > 0 else []
    top = max(values, default=0.0)
    cells = []
    for v in values:
        if v <= 0 or top <= 0:
            cells.append(BLOCKS[0])
        else:
            cells.append(BLOCKS[1 + min(len(BLOCKS) - 2, int(v / top * (len(BLOCKS) - 2)))])
    return " " * (width - len(cells)) + "".join(cells)


def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _uptime(seconds: int) -> str:
    h, rest = divmod(max(seconds, 0), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _plot_line(label: str, values: list[float], width: int, style: str) -> Text:
    # a fixed room for the peak keeps both plots' cells aligned whatever their maxima
    cells = max(8, min(2 * PLOT_WIDTH, width - PLOT_LABEL - len("max 999,999.9") - 2))
    peak = f"max {_num(max(values, default=None))}"
    return Text.assemble((label.ljust(PLOT_LABEL), "bold cyan"), " ", (sparkline(values, cells), style), " ", peak)


def render_frame(history: RateHistory, url: str, error: str | None = None, width: int = 120) -> Group:
    """One dashboard frame for a console `width` columns wide: a header, the figures as label/value pairs (two
    pairs a row from TWO_PAIRS_WIDTH columns), and the decode and prefill tok/s plots fitted to the width."""
    f = history.figures()
    header = Text.assemble(("helios top ", "bold"), url,
                           f"  window {f.span_s:.0f}/{history.window_s:.0f} s, {f.num_samples} samples")
    if history.num_restarts:
        header.append(f"  (server restarted: history reset {history.num_restarts}x)", "yellow")
    kv = f"{f.total_pages - f.free_pages}/{f.total_pages} used ({_num(f.used_pages_pct, '{:.0f}%')})"
    launches = ", ".join(f"{k} {v:,.1f}/s" for k, v in f.launches_per_s.items() if v) or "-"
    if f.weights_bytes_s is not None:
        weights = f"{f.weights_bytes_s / 1e9:,.2f} GB/s"
    else:
        weights = "n/a (undeclared)" if f.num_samples and not f.decode_weight_bytes else "-"
    left = [
        ("DECODE", _num(f.decode_tok_s, "{:,.1f} tok/s")),
        ("PREFILL", _num(f.prefill_tok_s, "{:,.1f} tok/s")),
        ("REQUESTS", _num(f.completed_per_s, "{:,.2f}/s")),
        ("FAILED", f"{f.failed} ({f.failed_in_window} in window)"),
        ("WEIGHTS", weights),
        ("DEPTH", _num(f.depth, "{:.2f}")),
        ("ACCEPT", "-" if f.acceptance is None else f"{100 * f.acceptance:.1f}%"),
        ("REUSE", f"{f.reused_tokens:,} tok"),
    ]
    right = [
        ("ACTIVE", str(f.active)),
        ("PENDING", str(f.pending)),
        ("KV PAGES", kv),
        ("CACHED", f"{f.cached_pages} pages"),
        ("ADMISSION", f"{f.admission_in_use}/{f.admission_slots}"),
        ("FIRST RESPONSE", _num(f.first_response_s, "{:.3f} s")),
        ("UPTIME", _uptime(f.uptime_s)),
        ("LAUNCHES", launches),
    ]
    rows = [a + b for a, b in zip(left, right)] if width >= TWO_PAIRS_WIDTH else left + right
    table = Table(show_header=False, box=None, pad_edge=False, padding=(0, 1))
    # NOTE: labels never shrink; values wrap instead, so a narrow or piped console stays readable
    for i in range(len(rows[0]) // 2):
        table.add_column(no_wrap=True, min_width=max(len(row[2 * i]) for row in rows))
        table.add_column(overflow="fold", min_width=16 if i == 0 and len(rows[0]) > 2 else 0)
    for row in rows:
        table.add_row(*(Text(c, "bold cyan") if i % 2 == 0 else c for i, c in enumerate(row)))
    parts = [header, table,
             _plot_line("decode tok/s", history.rate_series("generated_tokens"), width, "green"),
             _plot_line("prefill tok/s", history.rate_series("prefill_tokens"), width, "magenta")]
    if error:
        parts.append(Text(f"error: {error}", "bold red"))
    return Group(*parts)
