"""Comparison reports over Hydra sweeps and runs: `python -m flexgemma.report DIR [DIR ...]`.

build_report is imported on first use, so that `python -m flexgemma.report` without the [report]
extra (matplotlib) says which extra to install instead of failing at import.
"""

from flexgemma.report.collect import ReportError

__all__ = ["Report", "ReportError", "build_report"]


def __getattr__(name: str):
    if name in ("Report", "build_report"):
        from flexgemma.report import build

        return getattr(build, name)
    raise AttributeError(f"module 'flexgemma.report' has no attribute {name!r}")
