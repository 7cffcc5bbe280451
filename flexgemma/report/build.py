"""build_report: collect the jobs, write report.md, report.html and the PNG plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flexgemma.report.collect import Collection, collect
from flexgemma.report.export import write_exports
from flexgemma.report.plots import PLOT_NAMES, Plot, make_plots
from flexgemma.report.render import write_html, write_markdown
from flexgemma.report.tables import Verdict, problems_table, resources_table, throughput_table, verdict


@dataclass
class Report:
    collection: Collection
    verdict: Verdict
    markdown: Path
    html: Path
    plots: list[Plot]
    exports: list[Path]  # report.csv, and report.parquet where pandas and pyarrow are installed


def build_report(dirs: list[str | Path], out: str | Path | None = None, title: str | None = None) -> Report:
    """Compares the jobs below `dirs` (a Hydra sweep dir, or several run dirs) and writes the
    report into `out` (default: the first dir). Raises ReportError when there is nothing to read."""
    coll = collect(dirs)
    out_dir = Path(out) if out is not None else Path(dirs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    title = title or f"flexgemma comparison: {Path(dirs[0]).resolve().name}"
    tables = [throughput_table(coll), resources_table(coll)]
    problems = problems_table(coll)
    if problems is not None:
        tables.append(problems)
    v = verdict(coll)
    for table in tables:  # bold only a crowned configuration (none when inert keys or noise decide)
        table.best_row = next((i for i, j in enumerate(table.jobs) if j is v.best), None)
    for old in out_dir.glob("*.png"):  # plots of an earlier report here would look like current ones
        if old.name in PLOT_NAMES or old.name.startswith("throughput_vs_"):
            old.unlink()
    plots = make_plots(coll, out_dir)
    md = write_markdown(out_dir / "report.md", coll, v, tables, plots, title)
    page = write_html(out_dir / "report.html", coll, v, tables, plots, title)
    exports = write_exports(out_dir, coll)
    return Report(collection=coll, verdict=v, markdown=md, html=page, plots=plots, exports=exports)
