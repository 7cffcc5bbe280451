"""The jobs as a table for pandas, spreadsheets and notebooks: report.csv (always) and
report.parquet (when pandas and pyarrow are installed), one row per job.

Columns: job, directory, status, error, the swept keys (as typed), then every scalar of the jobs'
summary.json in sorted order (the metric names of flexgemma/run/metrics.py). Lists and mappings
(samples, choices) are left out: they do not fit a cell.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from flexgemma.report.collect import Collection

SCALARS = (str, int, float, bool)
LEFT_OUT = ("status", "error", "traceback", "stderr_tail")  # status and error have columns; tracebacks are long


def rows(coll: Collection) -> tuple[list[str], list[dict[str, Any]]]:
    metrics = sorted({k for j in coll.jobs for k, v in j.summary.items()
                      if isinstance(v, SCALARS) and k not in LEFT_OUT and k not in coll.swept_keys})
    header = ["job", "directory", "status", "error", *coll.swept_keys, *metrics]
    out = []
    for j in coll.jobs:
        row: dict[str, Any] = {"job": j.name, "directory": str(j.dir), "status": j.status, "error": j.error or ""}
        row.update({k: j.swept.get(k, "") for k in coll.swept_keys})
        row.update({k: j.summary.get(k, "") for k in metrics if isinstance(j.summary.get(k), SCALARS)})
        out.append(row)
    return header, out


def write_csv(path: Path, coll: Collection) -> Path:
    header, data = rows(coll)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(data)
    return path


def write_parquet(path: Path, csv_path: Path) -> Path | None:
    """report.parquet from the CSV (pandas infers one type a column), or None without pandas/pyarrow."""
    try:
        import pandas as pd
        import pyarrow  # noqa: F401  (pandas' parquet engine)
    except ImportError:
        return None
    pd.read_csv(csv_path, dtype={"job": str}).to_parquet(path, index=False)
    return path


def write_exports(out_dir: Path, coll: Collection) -> list[Path]:
    csv_path = write_csv(out_dir / "report.csv", coll)
    parquet = write_parquet(out_dir / "report.parquet", csv_path)
    return [csv_path] + ([parquet] if parquet else [])
