"""`--wandb-report ENTITY/PROJECT`: the same comparison as a W&B report, for users with a server.

Built with wandb-workspaces (`wandb_workspaces.reports.v2`), an optional package: the local
report never needs it. The W&B report reads the runs the jobs logged (logger=wandb_online, or
offline runs uploaded with `wandb sync`), so its panels are live views of those runs rather than
copies of the local tables.
"""

from __future__ import annotations

import os

from flexgemma.report.build import Report
from flexgemma.report.collect import Collection
from flexgemma.report.tables import OUTPUT

SUMMARY_PANELS = [  # (summary key, bar chart title)
    (OUTPUT, "Output tokens/s (median over rounds)"),
    ("throughput/decode_tok_s_median", "Decode tokens/s (median over rounds)"),
    ("latency/tpot_p50_ms", "Time per output token p50 (ms)"),
    ("memory/peak_allocated_gib", "Peak allocated memory (GiB)"),
]


class WandbReportError(Exception):
    """The W&B report cannot be made (package missing, offline, not logged in); says what to do."""


def publish_wandb_report(report: Report, target: str, group: str | None = None) -> str:
    """Saves a W&B report comparing the runs of `target` ("ENTITY/PROJECT" or "PROJECT"),
    restricted to the W&B run group `group` when given; returns the report's URL."""
    entity, _, project = target.rpartition("/")
    if not project:
        raise WandbReportError(f"--wandb-report {target!r}: give ENTITY/PROJECT or PROJECT")
    try:
        import wandb_workspaces.reports.v2 as wr  # first: it is the one that may be missing
        import wandb
    except ImportError as e:
        raise WandbReportError(
            f"--wandb-report needs the wandb-workspaces package ({e}); install it with "
            "`pip install wandb-workspaces`. The local report.md / report.html were written.") from None
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        raise WandbReportError(f"--wandb-report needs an online W&B server, but WANDB_MODE={mode}. "
                               "The local report.md / report.html were written.")
    try:
        api = wandb.Api(timeout=30)
        entity = entity or api.default_entity
    except Exception as e:  # noqa: BLE001 - wandb raises several kinds for "no key" / "no network"
        raise WandbReportError(f"--wandb-report cannot reach W&B ({type(e).__name__}: {e}); log in with "
                               "`wandb login` (or set WANDB_API_KEY / WANDB_BASE_URL).") from None
    if not entity:
        raise WandbReportError("--wandb-report: no W&B entity given and none is the default; use ENTITY/PROJECT")

    runset = wr.Runset(entity=entity, project=project, name=group or "all runs",
                       filters=f"Metric('Group') == {group!r}" if group else "")
    panels = [wr.BarPlot(title=title, metrics=[wr.SummaryMetric(key)], orientation="h",
                         layout=wr.Layout(x=12 * (i % 2), y=8 * (i // 2), w=12, h=8))
              for i, (key, title) in enumerate(SUMMARY_PANELS)]
    columns = [wr.ParallelCoordinatesPlotColumn(metric=wr.Config(k)) for k in _config_keys(report.collection)]
    columns.append(wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(OUTPUT), display_name="output tok/s"))
    panels.append(wr.ParallelCoordinatesPlot(title="Swept keys vs output tokens/s", columns=columns,
                                             layout=wr.Layout(x=0, y=16, w=24, h=10)))
    panels.append(wr.RunComparer(diff_only="split", layout=wr.Layout(x=0, y=26, w=24, h=12)))
    v = report.verdict
    blocks = [wr.P(v.headline), *(wr.P(n) for n in v.notes)]
    if v.command:
        blocks.append(wr.P(["Re-run the best configuration: ", wr.InlineCode(v.command)]))
    blocks.append(wr.PanelGrid(runsets=[runset], panels=panels))
    wb_report = wr.Report(entity=entity, project=project, title=f"flexgemma comparison: {group or project}",
                          description=v.headline, blocks=blocks)
    wb_report.save()
    return wb_report.url


def _config_keys(coll: Collection) -> list[str]:
    """W&B config paths of the swept keys; a group choice (cudagraph=ladder16) is its `.name`."""
    keys = []
    for key in coll.swept_keys:
        has_name = any(j.config and f"{key}.name" in j.config for j in coll.jobs)
        keys.append(f"{key}.name" if "." not in key and has_name else key)
    return keys
