#!/usr/bin/env python3
"""Draws ops/grafana/idem.json as an SVG (docs/dashboard.svg), so the
operations guide shows the dashboard without Grafana.

The layout, titles, units, legends and colours are the dashboard's own (its
gridPos, targets, legendFormat, thresholds and overrides); the values are
illustrative, drawn from a fixed seed: six hours of a service paying and
refunding, with Redis failing on one instance for twenty minutes. Python 3
alone, no packages.

    python3 ops/grafana/render.py            # writes docs/dashboard.svg
    python3 ops/grafana/render.py --check    # exits 1 if the file is stale
"""

import json
import math
import random
import re
import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops/grafana/idem.json"
OUT = ROOT / "docs/dashboard.svg"

WIDTH = 1200
UNIT_W = WIDTH / 24
UNIT_H = 30
POINTS = 72  # six hours, a point each five minutes
OUTAGE = range(44, 48)  # Redis failing on one instance: points 44 to 47
BG, PANEL, BORDER, TEXT, DIM = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e8e"
PALETTE = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#b877d9", "#8ab8ff", "#fade2a", "#96d98d"]
COLORS = {"red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a", "green": "#73bf69", "blue": "#5794f2"}

# Label values the illustrative series take, by label.
VALUES = {
    "biz": ["pay", "refund"],
    "outcome": ["executed", "replayed", "in_progress", "key_reused", "rejected", "failed"],
    "source": ["redis", "local", "database", "memory"],
    "instance": ["10.0.0.11:3000", "10.0.0.12:3000"],
    "action": ["ack", "retry", "dead_letter_poison"],
    "exported_job": ["nightly_report"],
    "result": ["sent", "refused", "dead"],
}
# Calls per second of each outcome, and of each biz.
OUTCOME_RATE = {"executed": 40, "replayed": 12, "in_progress": 1.2, "key_reused": 0.3, "rejected": 0.2, "failed": 0.15}
BIZ_SHARE = {"pay": 0.7, "refund": 0.3}


def walk(panels):
    for panel in panels:
        yield panel
        yield from walk(panel.get("panels", []))


def labels_of(target):
    """The label names a target's legend names, in order."""
    return re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", ""))


def outage(i):
    return i in OUTAGE


def value(labels, i, expr, rng):
    """An illustrative value at point `i` of the series with `labels`."""
    wave = 1 + 0.25 * math.sin(i / 11) + rng.uniform(-0.06, 0.06)
    share = BIZ_SHARE.get(labels.get("biz"), 1)
    if "idem_redis_degraded_total" in expr:
        return 1 if i == OUTAGE[0] and labels.get("instance", "").endswith("12:3000") else 0
    if "idem_redis_degraded" in expr:
        return 1 if outage(i) and labels.get("instance", "").endswith("12:3000") else 0
    if "idem_replays_total" in expr:
        source = labels.get("source")
        base = {"redis": 9, "local": 2.5, "database": 0.4, "memory": 0.1}[source]
        if outage(i):
            base = {"redis": 4.5, "local": 2.5, "database": 4.9, "memory": 0.3}[source]
        return base * wave
    if "idem_call_duration" in expr:
        p99 = "0.99" in expr
        base = (0.012 if p99 else 0.0021) * (1 + 0.3 * (labels.get("biz") == "refund"))
        return base * (2.8 if outage(i) and p99 else 1.6 if outage(i) else 1) * wave
    if "idem_background_releases_total" in expr:
        return (0.08 if outage(i) else 0.004) * wave
    if "settlements_total" in expr:
        if not expr.startswith("sum by (action) (rate(idem_consumer"):
            return None  # one transport in use: RabbitMQ
        action = labels.get("action")
        return {"ack": 18 * wave, "retry": 0.6 * wave, "dead_letter_poison": 2.5 if i in (30, 31, 58) else 0}[action]
    if "idem_cron_slots_total" in expr:
        # Hourly, on two instances: one runs the slot, the other finds it done.
        return 1 if labels.get("outcome") in ("executed", "done_elsewhere") and i % 12 == 0 else 0
    if "idem_outbox_batches_total" in expr:
        return 1.8 * wave
    if "idem_outbox_messages_total" in expr:
        result = labels.get("result")
        return {"sent": 11 * wave, "refused": (0.5 if i in (50, 51) else 0.02) * wave, "dead": 0}[result]
    if "idem_calls_total" in expr:
        outcome = labels.get("outcome")
        if outcome is None:
            return sum(OUTCOME_RATE.values()) * share * wave
        rate = OUTCOME_RATE[outcome]
        if outage(i) and outcome == "in_progress":
            rate *= 2.5
        return rate * share * wave
    return wave


def series(panel, rng):
    """`[(name, color, [values])]` of a panel's targets."""
    out = []
    for target in panel["targets"]:
        expr = target["expr"]
        if "histogram_quantile" in expr:
            continue  # the buckets' form: the default exporter renders quantiles
        names = labels_of(target)
        combos = [{}]
        for name in names:
            values = VALUES.get(name, ["x"])
            if name == "outcome":
                wanted = re.search(r'outcome=~"([^"]+)"', expr)
                if wanted:
                    values = [v for v in values if re.fullmatch(wanted.group(1), v)]
                if "exported_job" in names:
                    values = ["executed", "done_elsewhere"]
            combos = [dict(c, **{name: v}) for c in combos for v in values]
        for combo in combos:
            points = [value(combo, i, expr, rng) for i in range(POINTS)]
            if points[0] is None:
                continue
            legend = target.get("legendFormat", "")
            for name, v in combo.items():
                legend = legend.replace("{{" + name + "}}", v)
            out.append((legend, override_color(panel, legend), points))
    for n, (legend, color, points) in enumerate(out):
        out[n] = (legend, color or PALETTE[n % len(PALETTE)], points)
    return out


def override_color(panel, name):
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        if re.fullmatch(override["matcher"]["options"], name):
            for prop in override["properties"]:
                if prop["id"] == "color":
                    return COLORS.get(prop["value"]["fixedColor"], prop["value"]["fixedColor"])
    fixed = panel.get("fieldConfig", {}).get("defaults", {}).get("color", {}).get("fixedColor")
    return COLORS.get(fixed) if fixed else None


def fmt(v, unit):
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "s":
        return f"{v * 1000:.1f} ms"
    if unit in ("reqps", "ops"):
        return f"{v:.2g}/s" if v < 10 else f"{v:.0f}/s"
    return f"{v:.0f}" if v == int(v) else f"{v:.2g}"


def box(out, x, y, w, h, title):
    out.append(f'<rect x="{x + 2:.1f}" y="{y + 2:.1f}" width="{w - 4:.1f}" height="{h - 4:.1f}" rx="3" '
               f'fill="{PANEL}" stroke="{BORDER}"/>')
    out.append(f'<text x="{x + 10:.1f}" y="{y + 20:.1f}" fill="{TEXT}" font-size="12" font-weight="600">'
               f'{escape(title)}</text>')


def draw_stat(out, panel, x, y, w, h, rng):
    box(out, x, y, w, h, panel["title"])
    unit = panel["fieldConfig"]["defaults"].get("unit")
    expr = panel["targets"][0]["expr"]
    if "replayed" in expr:
        v = OUTCOME_RATE["replayed"] / sum(OUTCOME_RATE.values())
    elif 'outcome="failed"' in expr:
        v = OUTCOME_RATE["failed"] / sum(OUTCOME_RATE.values())
    elif "dead_letter" in expr:
        v = 3
    elif unit == "reqps":
        v = sum(OUTCOME_RATE.values())
    else:
        v = 0
    color = COLORS["blue"]
    steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps")
    if steps:
        for step in steps:
            if step["value"] is None or v >= step["value"]:
                color = COLORS.get(step["color"], step["color"])
    out.append(f'<rect x="{x + 8:.1f}" y="{y + 30:.1f}" width="{w - 16:.1f}" height="{h - 40:.1f}" rx="2" '
               f'fill="{color}" fill-opacity="0.85"/>')
    out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 20:.1f}" fill="#ffffff" font-size="30" '
               f'font-weight="600" text-anchor="middle">{escape(fmt(v, unit))}</text>')


def draw_timeseries(out, panel, x, y, w, h, rng):
    box(out, x, y, w, h, panel["title"])
    lines = series(panel, rng)
    unit = panel["fieldConfig"]["defaults"].get("unit")
    legend_rows = max(1, math.ceil(len(lines) / max(1, int(w // 150))))
    px, py, pw, ph = x + 44, y + 30, w - 56, h - 48 - 14 * legend_rows
    top = max((max(p) for _, _, p in lines), default=1) or 1
    top *= 1.15
    for k in range(3):
        gy = py + ph * k / 2
        out.append(f'<line x1="{px:.1f}" y1="{gy:.1f}" x2="{px + pw:.1f}" y2="{gy:.1f}" stroke="{BORDER}"/>')
        out.append(f'<text x="{px - 4:.1f}" y="{gy + 4:.1f}" fill="{DIM}" font-size="9" text-anchor="end">'
                   f'{escape(fmt(top * (1 - k / 2), unit))}</text>')
    custom = panel["fieldConfig"]["defaults"].get("custom", {})
    bars = custom.get("drawStyle") == "bars"
    step = custom.get("lineInterpolation") == "stepAfter"
    for n, (name, color, points) in enumerate(lines):
        xs = [px + pw * i / (POINTS - 1) for i in range(POINTS)]
        ys = [py + ph * (1 - v / top) for v in points]
        if bars:
            # Side by side, as Grafana draws the bars of several series.
            for xi, yi in zip(xs, ys):
                if yi < py + ph - 0.5:
                    out.append(f'<rect x="{xi - 2 + 4 * n:.1f}" y="{yi:.1f}" width="4" height="{py + ph - yi:.1f}" '
                               f'fill="{color}"/>')
            continue
        if step:
            coords = []
            for n, (xi, yi) in enumerate(zip(xs, ys)):
                if n:
                    coords.append(f"{xi:.1f},{ys[n - 1]:.1f}")
                coords.append(f"{xi:.1f},{yi:.1f}")
        else:
            coords = [f"{xi:.1f},{yi:.1f}" for xi, yi in zip(xs, ys)]
        width = 3 if color == COLORS["red"] and not step else 1.5
        fill = custom.get("fillOpacity", 10) / 100
        area = f"{xs[0]:.1f},{py + ph:.1f} " + " ".join(coords) + f" {xs[-1]:.1f},{py + ph:.1f}"
        out.append(f'<polygon points="{area}" fill="{color}" fill-opacity="{fill:.2f}" stroke="none"/>')
        out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{color}" stroke-width="{width}"/>')
    per_row = max(1, int(w // 150))
    for n, (name, color, _) in enumerate(lines):
        lx = x + 12 + (n % per_row) * 150
        ly = y + h - 12 - 14 * (legend_rows - 1 - n // per_row)
        out.append(f'<rect x="{lx:.1f}" y="{ly - 7:.1f}" width="10" height="3" fill="{color}"/>')
        out.append(f'<text x="{lx + 14:.1f}" y="{ly:.1f}" fill="{TEXT}" font-size="10">{escape(name[:30])}</text>')


def draw_table(out, panel, x, y, w, h, rng):
    box(out, x, y, w, h, panel["title"])
    cols = ["biz", "outcome", "calls"]
    rows = []
    for biz in VALUES["biz"]:
        for outcome in VALUES["outcome"]:
            calls = round(OUTCOME_RATE[outcome] * BIZ_SHARE[biz] * 3600 * 6)
            rows.append((biz, outcome, f"{calls:,}".replace(",", " ")))
    cx = [x + 12, x + 12 + (w - 24) * 0.3, x + w - 12]
    ty = y + 42
    for n, col in enumerate(cols):
        anchor = "end" if n == 2 else "start"
        out.append(f'<text x="{cx[n]:.1f}" y="{ty:.1f}" fill="{DIM}" font-size="10" font-weight="600" '
                   f'text-anchor="{anchor}">{col}</text>')
    for r, row in enumerate(rows[: int((h - 56) // 14)]):
        ry = ty + 15 + 14 * r
        for n, cell in enumerate(row):
            anchor = "end" if n == 2 else "start"
            out.append(f'<text x="{cx[n]:.1f}" y="{ry:.1f}" fill="{TEXT}" font-size="10" text-anchor="{anchor}">'
                       f'{escape(cell)}</text>')


def render():
    dash = json.loads(DASHBOARD.read_text())
    panels = list(walk(dash["panels"]))
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    header = 44
    height = header + bottom * UNIT_H + 24
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="Inter, Helvetica, Arial, sans-serif">',
           f'<rect width="{WIDTH}" height="{height}" fill="{BG}"/>',
           f'<text x="12" y="28" fill="{TEXT}" font-size="18" font-weight="600">{escape(dash["title"])}</text>',
           f'<text x="{WIDTH - 12}" y="28" fill="{DIM}" font-size="11" text-anchor="end">'
           f'ops/grafana/idem.json, drawn by ops/grafana/render.py: illustrative values, last 6 hours</text>']
    for panel in panels:
        g = panel["gridPos"]
        x, y, w, h = g["x"] * UNIT_W, header + g["y"] * UNIT_H, g["w"] * UNIT_W, g["h"] * UNIT_H
        rng = random.Random(panel["id"])
        if panel["type"] == "row":
            out.append(f'<text x="{x + 8:.1f}" y="{y + 20:.1f}" fill="{TEXT}" font-size="14" font-weight="600">'
                       f'{escape(panel["title"])}</text>')
        elif panel["type"] == "stat":
            draw_stat(out, panel, x, y, w, h, rng)
        elif panel["type"] == "timeseries":
            draw_timeseries(out, panel, x, y, w, h, rng)
        elif panel["type"] == "table":
            draw_table(out, panel, x, y, w, h, rng)
        else:
            raise SystemExit(f"render.py: panel type {panel['type']!r} is not drawn yet")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    svg = render()
    if sys.argv[1:] == ["--check"]:
        if not OUT.exists() or OUT.read_text() != svg:
            print(f"{OUT.relative_to(ROOT)} is stale: run python3 ops/grafana/render.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(svg)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(svg)} bytes)")


if __name__ == "__main__":
    main()
