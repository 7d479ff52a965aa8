"""The HTML of the pages: every value escaped, no script, a meta refresh for live updates."""

from __future__ import annotations

import time
from html import escape
from typing import Any, Optional, Sequence

from tether.ui import svg
from tether.ui.catalog import Detail, Row, SweepTable

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1.4em 0 .4em}
table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
progress{width:90px;vertical-align:middle}.step{white-space:nowrap}.error{color:#b00}.muted{color:#777}
.completed{color:#070}.failed,.lost,.stalled,.error{color:#b00}.running{color:#06c}
pre{background:#f6f6f6;padding:8px;max-height:28em;overflow:auto;white-space:pre-wrap}
form{display:inline;margin-left:.3em}.backend{margin-right:1.5em}.backends{margin:0 0 1em}
.chart{margin:4px 12px 4px 0;border:1px solid #eee}.chart .title{font-weight:bold}.chart text{font-size:11px}
"""


def e(value: Any) -> str:
    """`value` as HTML text, escaped (quotes too, so it is safe inside attributes)."""
    return escape("" if value is None else str(value), quote=True)


def page(title: str, body: str, refresh_s: Optional[float] = None) -> str:
    """A whole document; `refresh_s` reloads it that often (the live updates)."""
    meta = f'<meta http-equiv="refresh" content="{refresh_s:g}">' if refresh_s else ""
    return (f'<!doctype html><html><head><meta charset="utf-8">{meta}<title>{e(title)}</title>'
            f'<style>{STYLE}</style></head><body>{body}</body></html>')


def age(seconds: Optional[float]) -> str:
    """`12 s` or `5 min`; '' when unknown."""
    if seconds is None:
        return ""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def progress(row: Row) -> str:
    """step/total with a bar (just the step when the total is not known)."""
    if row.step is None:
        return ""
    if not row.total:
        return e(row.step)
    return (f'<span class="step"><progress value="{e(row.step)}" max="{e(row.total)}"></progress> '
            f'{e(row.step)}/{e(row.total)}</span>')


def measures(row: Row) -> str:
    """The last loss and the metrics, as one escaped line."""
    loss = f"loss {row.loss:.4g}" if row.loss is not None else ""
    return e("  ".join(filter(None, [loss] + [f"{k} {v:.4g}" for k, v in row.metrics])))


def runs_page(project: str, backends: Sequence[str], rows: Sequence[Row], sweeps: Sequence[SweepTable],
              refresh_s: float) -> str:
    """Every run, one row each; a Check button per backend; the sweeps' results tables."""
    buttons = "".join(f'<span class="backend">{e(b)} <form method="post" action="/check/{e(b)}">'
                      f'<button type="submit">Check</button></form></span>' for b in backends)
    head = ("<tr><th>run</th><th>backend</th><th>point</th><th>state</th><th>step</th><th>loss, metrics</th>"
            "<th>heartbeat</th><th>queue</th><th>host</th><th>attempt</th><th>verified here</th></tr>")
    body = "".join(_run_row(r) for r in rows) or '<tr><td colspan="11" class="muted">no run yet: ' \
                                                 '`doit run train` starts one</td></tr>'
    tables = "".join(sweep_table(t) for t in sweeps)
    return page(f"tether: runs of {project}", f"<h1>Runs of {e(project)}</h1>"
                f'<p class="muted">read-only; refreshed every {refresh_s:g} s; {time.strftime("%H:%M:%S")}</p>'
                f'<div class="backends">Backends: {buttons}</div>'
                f'<table id="runs">{head}{body}</table>{tables}', refresh_s)


def _run_row(r: Row) -> str:
    error = f'<div class="error">{e(r.error)}</div>' if r.error else ""
    cells = [f'<a href="/run/{e(r.run_id)}">{e(r.run_id)}</a>{error}', e(r.backend), e(r.point),
             f'<span class="{e(r.status)}">{e(r.status)}</span>', progress(r), measures(r),
             e(age(r.heartbeat_age_s)), e(r.queue), e(r.host), e(r.attempt), "yes" if r.verified else "no"]
    return f'<tr data-run="{e(r.run_id)}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def sweep_table(t: SweepTable) -> str:
    """results.md's table as HTML: one row per setting, mean ± sample sd over seeds, and n."""
    head = "".join(f"<th>{e(k)}</th>" for k in t.keys + ("n",) + t.metrics)
    rows = "".join("<tr>" + "".join(f'<td class="num">{e(c)}</td>' for c in row) + "</tr>" for row in t.rows)
    left = "".join(f"<li>{e(point)}: {e(why)}</li>" for point, why in t.excluded)
    left = f"<p>Left out (not averaged in):</p><ul>{left}</ul>" if left else ""
    return (f'<h2>Sweep results (backend {e(t.backend)})</h2><p class="muted">mean ± sample standard deviation '
            f'over seeds, from each verified point\'s metrics</p><table class="sweep">'
            f"<tr>{head}</tr>{rows}</table>{left}")


def run_page(d: Detail, refresh_s: float) -> str:
    """A run: its status values, curves, log tail, manifest and verification."""
    r = d.row
    values = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in d.row.details)
    error = f'<p class="error">{e(r.error)}</p>' if r.error else ""
    loss = {k: v for k, v in d.series.items() if k == "loss"}
    others = {k: v for k, v in d.series.items() if k != "loss"}
    curves = svg.chart("loss", loss) + "".join(svg.chart(k, {k: v}) for k, v in sorted(others.items()))
    live = refresh_s if r.status in ("running", "pending", "unknown") or r.error else None
    return page(f"tether: {r.run_id}", f'<p><a href="/">all runs</a></p><h1>{e(r.run_id)}</h1>{error}'
                f'<p>backend {e(r.backend)}; <span class="{e(r.status)}">{e(r.status)}</span> '
                f"{progress(r)}</p><h2>Curves</h2><div>{curves}</div>"
                f"<h2>Status</h2><table>{values}</table>"
                f'<h2>Log (last lines)</h2><pre id="log">{e(d.log)}</pre>'
                f"<h2>Verification</h2>{verification(d)}", live)


def verification(d: Detail) -> str:
    """PULL_VERIFIED.json here, and the manifest's files with their sizes and SHA-256."""
    if d.row.verified:
        at = (d.verified or {}).get("verified_at")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else ""
        verdict = f'<p class="completed">verified here {e(when)} (PULL_VERIFIED.json matches the manifest)</p>'
    elif d.verified:
        verdict = '<p class="error">not verified: files changed since PULL_VERIFIED.json was written; ' \
                  '`doit run verify` checks them again</p>'
    else:
        verdict = '<p class="muted">not verified here</p>'
    if not d.files:
        return verdict + f'<p class="muted">manifest: {e(d.manifest_note)}</p>'
    rows = "".join(f'<tr><td>{e(f.path)}</td><td class="num">{e(f.bytes)}</td><td><code>{e(f.sha256)}</code>'
                   f"</td></tr>" for f in d.files)
    return verdict + f"<table><tr><th>file</th><th>bytes</th><th>SHA-256</th></tr>{rows}</table>"


def check_page(backend: str, text: str) -> str:
    """What the backend's preflight said."""
    return page(f"tether: check {backend}", f'<p><a href="/">all runs</a></p><h1>Check of backend {e(backend)}</h1>'
                f'<pre id="report">{e(text)}</pre>')


def message_page(code: int, text: str) -> str:
    """An error page: the status code and one line."""
    return page(f"tether: {code}", f"<h1>{code}</h1><p>{e(text)}</p>")
