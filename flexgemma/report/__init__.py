"""Comparison reports over Hydra sweeps and runs: `python -m flexgemma.report DIR [DIR ...]`."""

from flexgemma.report.build import Report, build_report
from flexgemma.report.collect import ReportError

__all__ = ["Report", "ReportError", "build_report"]
