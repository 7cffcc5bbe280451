"""`python -m flexgemma.report DIR [DIR ...] [--out OUT] [--wandb-report ENTITY/PROJECT]`."""

from __future__ import annotations

import argparse
import sys

from flexgemma.config.extras import MissingExtra
from flexgemma.report.collect import ReportError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m flexgemma.report",
        description="Compare flexgemma jobs: a Hydra multirun sweep dir, or several run dirs. Writes "
                    "report.md, a self-contained report.html and the PNG plots.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a sweep dir (jobs in subfolders) or run dirs")
    p.add_argument("--out", help="where to write the report (default: the first DIR)")
    p.add_argument("--title", help="the report's title (default: named after the first DIR)")
    p.add_argument("--wandb-report", metavar="ENTITY/PROJECT",
                   help="also save the comparison as a W&B report (needs wandb-workspaces and a server)")
    p.add_argument("--wandb-group", metavar="GROUP", help="with --wandb-report: only the runs of this W&B group")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from flexgemma.report.build import build_report

        report = build_report(args.dirs, out=args.out, title=args.title)
    except (ReportError, MissingExtra) as e:
        print(f"flexgemma.report: {e}", file=sys.stderr)
        return 2
    for line in report.collection.unreadable:  # the rest of the report is made without these files
        print(f"flexgemma.report: {line}", file=sys.stderr)
    print(report.verdict.headline)
    if report.verdict.command:
        print(f"  {report.verdict.command}")
    print(f"report: {report.markdown}\n        {report.html}")
    print("\n".join(f"        {p}" for p in report.exports))
    if args.wandb_report:
        from flexgemma.report.wandb_report import WandbReportError, publish_wandb_report

        try:
            print(f"W&B report: {publish_wandb_report(report, args.wandb_report, args.wandb_group)}")
        except WandbReportError as e:
            print(f"flexgemma.report: {e}", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
