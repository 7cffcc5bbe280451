"""Writes report.md (plots beside it as PNG files) and report.html (self-contained: CSS inline,
plots embedded as base64 data URIs, so the one file can be mailed or attached to an issue)."""

from __future__ import annotations

import base64
import html
from datetime import datetime
from pathlib import Path

from flexgemma.report.collect import Collection
from flexgemma.report.plots import Plot
from flexgemma.report.tables import Table, Verdict


def _sources(coll: Collection) -> str:
    return {"overrides": "the overrides that differ between jobs, read from .hydra/overrides.yaml",
            "config": "the config values that differ between jobs, read from config_resolved.yaml",
            "none": "every job ran the same configuration"}[coll.swept_from]


NO_PLOTS = "No plots: no job recorded throughput, memory or determinism (none finished ok)."

# ---------------------------------------------------------------- markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table) -> str:
    def row(cells: list[str], bold: bool = False) -> str:
        cells = [_md_cell(c) for c in cells]
        if bold:
            cells = [f"**{c}**" for c in cells]
        return "| " + " | ".join(cells) + " |"

    lines = [row(table.headers), "|" + "|".join("---:" if n else ":---" for n in table.numeric) + "|"]
    lines += [row(r, bold=i == table.best_row) for i, r in enumerate(table.rows)]
    return "\n".join(lines)


def write_markdown(path: Path, coll: Collection, verdict: Verdict, tables: list[Table], plots: list[Plot],
                   title: str) -> Path:
    out = [f"# {title}", "", f"**{verdict.headline}**", ""]
    out += [f"{n}" for n in verdict.notes] + [""]
    if verdict.command:
        out += ["Re-run the best configuration:", "", "```bash", verdict.command, "```", ""]
    out += [f"Jobs from: {', '.join(f'`{r}`' for r in coll.roots)}. Swept keys: "
            f"{', '.join(f'`{k}`' for k in coll.swept_keys) or 'none'} ({_sources(coll)}).", ""]
    for table in tables:
        out += [f"## {table.title}", ""]
        if table.note:
            out += [table.note, ""]
        if table.best_row is not None:
            out += ["The best job is in **bold**.", ""]
        out += [markdown_table(table), ""]
    if plots:
        out += ["## Plots", ""]
        for plot in plots:
            out += [f"### {plot.title}", "", plot.caption, "", f"![{plot.title}]({plot.path.name})", ""]
    else:
        out += ["## Plots", "", NO_PLOTS, ""]
    out += [_footer()]
    path.write_text("\n".join(out) + "\n")
    return path


# ---------------------------------------------------------------- html

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1400px; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
.verdict { background: #eef6ee; border-left: 5px solid #2ca02c; padding: .7em 1em; font-size: 1.08em; }
.verdict.none { background: #fbeaea; border-left-color: #d62728; }
pre { background: #f5f5f5; padding: .7em 1em; overflow-x: auto; }
.table-scroll { overflow-x: auto; max-width: 100%; }  /* a sweep's wide table scrolls, the page does not */
table { border-collapse: collapse; font-size: .9em; margin: .6em 0; }
th, td { border: 1px solid #ddd; padding: .3em .6em; white-space: nowrap; }
th { background: #f0f0f0; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { white-space: normal; max-width: 40em; }
tr.best td { font-weight: bold; background: #fff3c4; }
tr.status-failed td, tr.status-invalid td, tr.status-incomplete td, tr.status-unreadable td { color: #a31515; }
.note { color: #555; font-size: .9em; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9em; }
footer { margin-top: 3em; color: #888; font-size: .8em; }
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def html_table(table: Table, wrap_columns: tuple[str, ...] = ()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    body = []
    for i, (cells, job) in enumerate(zip(table.rows, table.jobs)):
        classes = [f"status-{job.status}"] + (["best"] if i == table.best_row else [])
        tds = []
        for header, cell, numeric in zip(table.headers, cells, table.numeric):
            cls = "num" if numeric else ("wrap" if header in wrap_columns else "")
            tds.append(f'<td class="{cls}">{_e(cell)}</td>' if cls else f"<td>{_e(cell)}</td>")
        body.append(f'<tr class="{" ".join(classes)}">{"".join(tds)}</tr>')
    return (f'<div class="table-scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def write_html(path: Path, coll: Collection, verdict: Verdict, tables: list[Table], plots: list[Plot],
               title: str) -> Path:
    parts = [f"<h1>{_e(title)}</h1>",
             f'<p class="verdict{"" if verdict.command else " none"}"><strong>{_e(verdict.headline)}</strong></p>']
    parts += [f"<p>{_e(n)}</p>" for n in verdict.notes]
    if verdict.command:
        parts += ["<p>Re-run the best configuration:</p>", f"<pre><code>{_e(verdict.command)}</code></pre>"]
    keys = ", ".join(f"<code>{_e(k)}</code>" for k in coll.swept_keys) or "none"
    roots = ", ".join(f"<code>{_e(r)}</code>" for r in coll.roots)
    parts.append(f'<p class="note">Jobs from {roots}. Swept keys: {keys} ({_e(_sources(coll))}).</p>')
    for table in tables:
        parts.append(f"<h2>{_e(table.title)}</h2>")
        if table.note:
            parts.append(f'<p class="note">{_e(table.note)}</p>')
        parts.append(html_table(table, wrap_columns=("error", "directory")))
    errors = [j for j in coll.problem_jobs if j.summary.get("traceback")]
    for job in errors:
        parts.append(f"<details><summary>Traceback of job {_e(job.name)} ({_e(job.label)})</summary>"
                     f"<pre>{_e(job.summary['traceback'])}</pre></details>")
    if plots:
        parts.append("<h2>Plots</h2>")
        for plot in plots:
            data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
            parts.append(f'<figure><h3>{_e(plot.title)}</h3><img alt="{_e(plot.title)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{_e(plot.caption)}</figcaption></figure>')
    else:
        parts += ["<h2>Plots</h2>", f"<p>{_e(NO_PLOTS)}</p>"]
    parts.append(f"<footer>{_e(_footer())}</footer>")
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
           f"<style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    path.write_text(doc)
    return path


def _footer() -> str:
    return f"Generated by python -m flexgemma.report on {datetime.now().isoformat(timespec='seconds')}."
