"""Small inline-SVG plots for the session report: no plotting library, no script, no network.

Each function returns one ``<svg>`` element as text, with a title, labelled axes and a legend, in
the page's colours: baseline grey, candidate blue.
"""

from __future__ import annotations

import html
import math

W, H, PAD = 420, 220, 46
BASE, CAND, INK = "#8a8f98", "#1f6feb", "#24292f"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _fmt(v: float) -> str:
    return f"{v:.2g}" if v and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.3g}"


def _frame(title: str, body: list[str], xlabel: str, ylabel: str) -> str:
    return (f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
            f'viewBox="0 0 {W} {H}" role="img"><title>{_esc(title)}</title>'
            f'<text x="{W / 2}" y="14" text-anchor="middle" font-size="12" fill="{INK}">{_esc(title)}</text>'
            f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="{INK}"/>'
            f'<line x1="{PAD}" y1="24" x2="{PAD}" y2="{H - PAD}" stroke="{INK}"/>'
            f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="11" fill="{INK}">{_esc(xlabel)}</text>'
            f'<text x="12" y="{H / 2}" text-anchor="middle" font-size="11" fill="{INK}" '
            f'transform="rotate(-90 12 {H / 2})">{_esc(ylabel)}</text>' + "".join(body) + "</svg>")


def _legend(items: list[tuple[str, str]]) -> list[str]:
    return [f'<rect x="{W - 120}" y="{24 + 14 * i}" width="10" height="10" fill="{c}"/>'
            f'<text x="{W - 106}" y="{33 + 14 * i}" font-size="10" fill="{INK}">{_esc(n)}</text>'
            for i, (n, c) in enumerate(items)]


def lines(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
          logy: bool = True) -> str:
    """Lines of (x, y) points on log2 x and (by default) log10 y axes: error against a size parameter."""
    pts = [(x, y) for s in series.values() for x, y in s if x > 0 and (y > 0 or not logy)]
    if not pts:
        return ""
    fx = lambda x: math.log2(x)  # noqa: E731
    fy = (lambda y: math.log10(y)) if logy else (lambda y: y)
    x0, x1 = min(fx(x) for x, _ in pts), max(fx(x) for x, _ in pts)
    y0, y1 = min(fy(y) for _, y in pts), max(fy(y) for _, y in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    sx = lambda x: PAD + (fx(x) - x0) / (x1 - x0) * (W - PAD - 130)  # noqa: E731
    sy = lambda y: H - PAD - (fy(y) - y0) / (y1 - y0) * (H - PAD - 34)  # noqa: E731
    body, colours = [], [BASE, CAND, "#d29922", "#cf222e"]
    for (name, s), colour in zip(series.items(), colours, strict=False):
        s = sorted((x, y) for x, y in s if x > 0 and (y > 0 or not logy))
        if not s:
            continue
        body.append(f'<polyline class="series" fill="none" stroke="{colour}" stroke-width="2" points="'
                    + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s) + '"/>')
        body += [f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                 f'<title>{_esc(name)}: {_fmt(y)} at {_fmt(x)}</title></circle>' for x, y in s]
    for x in sorted({x for x, _ in pts}):
        body.append(f'<text x="{sx(x):.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{_fmt(x)}</text>')
    for y in sorted({min(y for _, y in pts), max(y for _, y in pts)}):
        body.append(f'<text x="{PAD - 4}" y="{sy(y) + 3:.1f}" text-anchor="end" font-size="10">{_fmt(y)}</text>')
    return _frame(title, body + _legend([(n, c) for n, c in zip(series, colours, strict=False)]), xlabel, ylabel)


def strips(title: str, unit: str, groups: dict[str, list[float]], note: str = "") -> str:
    """Every sample of each group as a dot on one row, the median as a bar: an A/B distribution."""
    vals = [v for g in groups.values() for v in g]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    hi = hi if hi > lo else lo + (abs(lo) or 1.0)
    sx = lambda v: PAD + 50 + (v - lo) / (hi - lo) * (W - PAD - 80)  # noqa: E731
    body = []
    for i, (name, g) in enumerate(groups.items()):
        y, colour = 50 + 44 * i, (BASE, CAND)[i % 2]
        body.append(f'<text x="{PAD + 44}" y="{y + 4}" text-anchor="end" font-size="11">{_esc(name)}</text>')
        body += [f'<circle class="point" cx="{sx(v):.1f}" cy="{y}" r="3.5" fill="{colour}" fill-opacity="0.7">'
                 f'<title>{_fmt(v)} {_esc(unit)}</title></circle>' for v in g]
        med = sorted(g)[len(g) // 2]
        body.append(f'<line x1="{sx(med):.1f}" y1="{y - 12}" x2="{sx(med):.1f}" y2="{y + 12}" stroke="{colour}" '
                    f'stroke-width="3"><title>median {_fmt(med)} {_esc(unit)}</title></line>')
    body += [f'<text x="{sx(v):.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{_fmt(v)}</text>'
             for v in (lo, hi)]
    if note:
        body.append(f'<text x="{PAD + 50}" y="{H - PAD - 8}" font-size="10" fill="{INK}">{_esc(note)}</text>')
    return _frame(title, body, unit, "")


def bars(title: str, values: dict[str, float], ceiling: float = 1.0, label: str = "of the copy bandwidth") -> str:
    """Horizontal bars against a ceiling (a roofline position: achieved over measured peak)."""
    if not values:
        return ""
    top = max([ceiling, *values.values()])
    sx = lambda v: PAD + 60 + v / top * (W - PAD - 110)  # noqa: E731
    body = [f'<line x1="{sx(ceiling):.1f}" y1="30" x2="{sx(ceiling):.1f}" y2="{H - PAD}" stroke="#cf222e" '
            f'stroke-dasharray="4 3"><title>ceiling</title></line>']
    for i, (name, v) in enumerate(values.items()):
        y = 40 + 34 * i
        body.append(f'<text x="{PAD + 54}" y="{y + 13}" text-anchor="end" font-size="11">{_esc(name)}</text>')
        body.append(f'<rect class="bar" x="{sx(0):.1f}" y="{y}" width="{max(sx(v) - sx(0), 1):.1f}" height="18" '
                    f'fill="{(BASE, CAND)[i % 2]}"><title>{v:.0%} {_esc(label)}</title></rect>')
        body.append(f'<text x="{sx(v) + 4:.1f}" y="{y + 13}" font-size="10">{v:.0%}</text>')
    return _frame(title, body, label, "")


PALETTE = ("#1f6feb", "#d29922", "#1a7f37", "#cf222e", "#8250df", "#bf3989", "#0a7ea4", "#953800")


def timeline(title: str, sides: dict[str, list], width: int = 860, lane: int = 9) -> str:
    """Spans per thread on a shared time axis, one panel per side (baseline above candidate): a thread
    that waits shows as long bars where the other side has short ones.  ``sides`` maps a label to spans
    with ``thread``, ``name``, ``start_ms``, ``dur_ms`` and ``depth`` (a nested span is drawn in a lane
    below the one around it); colours by span name (the 8 most frequent)."""
    spans = [s for ss in sides.values() for s in ss]
    if not spans:
        return ""
    lanes: dict[str, int] = {}
    for s in spans:
        lanes[s.thread] = max(lanes.get(s.thread, 1), s.depth + 1)
    threads = sorted(lanes)
    offset, y = {}, 18
    for t in threads:
        offset[t], y = y, y + lanes[t] * lane + 6
    panel = y + 8
    counts: dict[str, int] = {}
    for s in spans:
        counts[s.name] = counts.get(s.name, 0) + 1
    colour = {n: PALETTE[i] for i, n in enumerate(sorted(counts, key=lambda n: (-counts[n], n))[:len(PALETTE)])}
    end = max(s.start_ms + s.dur_ms for s in spans) or 1.0
    left, top = 150, 30
    sx = lambda ms: left + ms / end * (width - left - 20)  # noqa: E731
    height = top + panel * len(sides) + 40 + 14 * ((len(colour) + 3) // 4)
    body = []
    for p, (side, ss) in enumerate(sides.items()):
        y0 = top + p * panel
        body.append(f'<text x="8" y="{y0 + 12}" font-size="11" font-weight="bold" fill="{INK}">{_esc(side)}'
                    f'{"" if ss else " (no events)"}</text>')
        for t in threads:
            y, h = y0 + offset[t], lanes[t] * lane
            body.append(f'<text x="{left - 6}" y="{y + min(h, 2 * lane) / 2 + 4:.1f}" text-anchor="end" font-size="10" '
                        f'fill="{INK}">{_esc(t[-24:])}</text>')
            body.append(f'<line x1="{left}" y1="{y + h + 2}" x2="{width - 20}" y2="{y + h + 2}" stroke="#eaeef2"/>')
        for s in ss:
            y = y0 + offset[s.thread] + s.depth * lane
            body.append(f'<rect class="span" x="{sx(s.start_ms):.1f}" y="{y + 1}" '
                        f'width="{max(sx(s.start_ms + s.dur_ms) - sx(s.start_ms), 0.8):.1f}" height="{lane - 2}" '
                        f'fill="{colour.get(s.name, BASE)}"><title>{_esc(s.thread)}: {_esc(s.name)} '
                        f'{_fmt(s.dur_ms)} ms at {_fmt(s.start_ms)} ms</title></rect>')
    axis = top + panel * len(sides)
    body.append(f'<line x1="{left}" y1="{axis}" x2="{width - 20}" y2="{axis}" stroke="{INK}"/>')
    body += [f'<text x="{sx(v):.1f}" y="{axis + 13}" text-anchor="middle" font-size="10">{_fmt(v)}</text>'
             for v in (0.0, end / 2, end)]
    body.append(f'<text x="{(left + width) / 2}" y="{axis + 26}" text-anchor="middle" font-size="11">ms</text>')
    for i, (name, c) in enumerate(colour.items()):
        x, y = 8 + 210 * (i % 4), axis + 34 + 14 * (i // 4)
        body.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{c}"/>'
                    f'<text x="{x + 14}" y="{y + 9}" font-size="10" fill="{INK}">{_esc(name[:30])}</text>')
    return (f'<svg class="plot timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img"><title>{_esc(title)}</title>'
            f'<text x="{width / 2}" y="14" text-anchor="middle" font-size="12" fill="{INK}">{_esc(title)}</text>'
            + "".join(body) + "</svg>")
