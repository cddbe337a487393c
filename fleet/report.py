"""A self-contained HTML fleet report: summary table plus inline SVG line charts, no scripts, no CDN.

Pure: rows in (from fleet.queries.tps and fleet.queries.timeseries), one HTML string out, so it can be
mailed, archived or opened offline. Per model@version there are two charts over time, median decode
tokens/s and median TTFT, with one line per device (the busiest MAX_DEVICE_LINES of them) and a thick
line for the median across devices.

    html = render_report(summary_rows, series_rows, title="Fleet report, last 24h")
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape

WIDTH, HEIGHT = 760, 280  # px, the SVG viewBox
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 60, 170, 28, 34  # px; the right margin holds the legend
MAX_DEVICE_LINES = 12  # more lines than this are unreadable; the rest still count in the median line
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#393b79", "#ad494a")
METRICS = (("decode_tps_p50", "Decode tokens/s (median)"), ("ttft_p50_ms", "Time to first token, ms (median)"))
MEDIAN = "all devices (median)"

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 24px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
svg.chart { display: block; margin: 8px 0 24px; background: #fff; border: 1px solid #eee; }
svg.chart text { font: 11px system-ui, sans-serif; fill: #444; }
svg.chart .grid { stroke: #eee; }
svg.chart .axis { stroke: #999; }
"""


def render_report(summary: list[dict], series: list[dict], title: str, generated_at: float | None = None,
                  adapters: list[dict] = ()) -> str:
    """adapters: fleet.queries.tps rows by adapter, a table of their own when any request used one."""
    generated = datetime.fromtimestamp(generated_at, timezone.utc) if generated_at else datetime.now(timezone.utc)
    by_model: dict[str, list[dict]] = defaultdict(list)
    for row in series:
        by_model[row["model"]].append(row)
    colours = device_colours(sorted({r["device"] for r in series}))
    sections = [_model_section(model, rows, colours) for model, rows in sorted(by_model.items())]
    body = "\n".join(sections) if sections else "<p>No requests in this window.</p>"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n<h1>{escape(title)}</h1>\n"
            f"<p>Generated {generated:%Y-%m-%d %H:%M} UTC. Times are device clocks, UTC.</p>\n"
            f"{_table(summary)}\n{_adapter_table(adapters)}{body}\n</body></html>\n")


def _adapter_table(rows: list[dict]) -> str:
    used = any(":" in r["adapter"] for r in rows)  # MODEL:ADAPTER@VERSION; the base alone is MODEL
    return f"<h2>By LoRA adapter</h2>\n{_table(rows)}\n" if used else ""


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v) -> str:
    return "" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)


def device_colours(device_ids: list[str]) -> dict[str, str]:
    """One colour per device for the whole report, so a device looks the same in every chart."""
    return {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(device_ids)} | {MEDIAN: "#000"}


def _model_section(model: str, rows: list[dict], colours: dict[str, str]) -> str:
    lines = _lines(rows)
    charts = "".join(line_chart(f"{model}: {label}", _pick(lines, metric), colours) for metric, label in METRICS)
    return f"<section><h2>{escape(model)}</h2>{charts}</section>"


def _lines(rows: list[dict]) -> dict[str, list[dict]]:
    """Device -> its points, busiest devices first, plus the per-bucket median across all devices."""
    per_device: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        per_device[r["device"]].append(r)
    busiest = sorted(per_device, key=lambda d: (-sum(r["requests"] for r in per_device[d]), d))
    lines = {d: per_device[d] for d in busiest[:MAX_DEVICE_LINES]}
    by_t: dict[float, list[dict]] = defaultdict(list)
    for r in rows:
        by_t[r["t"]].append(r)
    lines[MEDIAN] = [{"t": t, **{m: _median([r[m] for r in rs]) for m, _ in METRICS}} for t, rs in sorted(by_t.items())]
    return lines


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _pick(lines: dict[str, list[dict]], metric: str) -> dict[str, list[tuple[float, float]]]:
    return {name: [(p["t"], p[metric]) for p in points if p[metric] is not None] for name, points in lines.items()}


# ---- SVG ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """Data -> SVG coordinates: t in [t0, t1] seconds across the plot, value in [0, y1] up it."""

    t0: float
    t1: float
    y1: float

    def x(self, t: float) -> float:
        return MARGIN_LEFT + (t - self.t0) / ((self.t1 - self.t0) or 1) * (WIDTH - MARGIN_LEFT - MARGIN_RIGHT)

    def y(self, v: float) -> float:
        return HEIGHT - MARGIN_BOTTOM - v / self.y1 * (HEIGHT - MARGIN_TOP - MARGIN_BOTTOM)


def line_chart(title: str, lines: dict[str, list[tuple[float, float]]], colours: dict[str, str] | None = None) -> str:
    """An SVG line chart: one polyline (plus point markers) per named series of (t seconds, value)."""
    colours = colours or device_colours(list(lines))
    points = [p for pts in lines.values() for p in pts]
    if not points:
        return f"<p>{escape(title)}: no data.</p>"
    frame = Frame(min(p[0] for p in points), max(p[0] for p in points), _nice_ceiling(max(p[1] for p in points)))
    parts = [_axes(frame)]
    for i, (name, pts) in enumerate(lines.items()):
        colour, width = colours.get(name, PALETTE[i % len(PALETTE)]), 3 if name == MEDIAN else 1.5
        parts.append(_series(name, pts, colour, width, frame))
        parts.append(_legend_entry(i, name, colour, width))
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">'
            f'<title>{escape(title)}</title><text x="{MARGIN_LEFT}" y="16" font-weight="bold">{escape(title)}</text>'
            + "".join(parts) + "</svg>")


def _series(name: str, pts: list[tuple[float, float]], colour: str, width: float, frame: Frame) -> str:
    xy = [(frame.x(t), frame.y(v)) for t, v in pts]
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}"/>' for x, y in xy)
    return (f'<g class="series" data-name="{escape(name)}"><polyline fill="none" stroke="{colour}" '
            f'stroke-width="{width}" points="{coords}"/>{dots}</g>')


def _legend_entry(i: int, name: str, colour: str, width: float) -> str:
    x, y = WIDTH - MARGIN_RIGHT + 12, MARGIN_TOP + 8 + i * 16
    return (f'<line x1="{x}" y1="{y}" x2="{x + 16}" y2="{y}" stroke="{colour}" stroke-width="{width}"/>'
            f'<text x="{x + 22}" y="{y + 4}">{escape(name[:22])}</text>')


def _axes(frame: Frame) -> str:
    left, right, bottom = MARGIN_LEFT, WIDTH - MARGIN_RIGHT, HEIGHT - MARGIN_BOTTOM
    parts = [f'<line class="axis" x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}"/>',
             f'<line class="axis" x1="{left}" y1="{MARGIN_TOP}" x2="{left}" y2="{bottom}"/>']
    for k in range(5):
        v = frame.y1 * k / 4
        parts.append(f'<line class="grid" x1="{left}" y1="{frame.y(v):.1f}" x2="{right}" y2="{frame.y(v):.1f}"/>'
                     f'<text x="{left - 6}" y="{frame.y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    span_s = frame.t1 - frame.t0
    fmt = "%m-%d %H:%M" if span_s > 86400 else "%H:%M"
    for k in range(5 if span_s > 0 else 1):
        t = frame.t0 + span_s * k / 4
        label = datetime.fromtimestamp(t, timezone.utc).strftime(fmt)
        parts.append(f'<text x="{frame.x(t):.1f}" y="{bottom + 18}" text-anchor="middle">{label}</text>')
    return "".join(parts)


def _nice_ceiling(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5, 10 x 10^k at or above v (a readable axis top)."""
    if v <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(v))
    return next(step * scale for step in (1, 2, 2.5, 5, 10) if step * scale >= v * (1 - 1e-12))
