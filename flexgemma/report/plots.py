"""The report's PNG plots, drawn with matplotlib's object API on the Agg canvas.

Figures are built as `matplotlib.figure.Figure` objects (not through pyplot), so no GUI backend is
ever touched and nothing stays registered in pyplot's global figure list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from pathlib import Path

try:
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
except ImportError as e:  # the [report] extra
    from flexgemma.config.extras import missing_extra

    raise missing_extra("matplotlib", "report", "python -m flexgemma.report (its plots)", str(e)) from None

from flexgemma.report.collect import MISSING, Collection, Job
from flexgemma.report.tables import OUTPUT, determinism_keys, job_label, ranked_jobs, short_keys

THROUGHPUTS = [  # (summary median key, per-round key, panel title)
    (OUTPUT, "throughput/output_tok_s", "output"),
    ("throughput/decode_tok_s_median", "throughput/decode_tok_s", "decode"),
    ("throughput/prefill_tok_s_median", "throughput/prefill_tok_s", "prefill"),
]
MEMORY = [  # (summary key, legend label), beside each job's peak
    ("memory/peak_reserved_gib", "peak reserved (GPU)"),
    ("memory/weights_gib", "weights"),
    ("memory/kv_pool_gib", "KV pool"),
    ("memory/graph_pool_gib", "CUDA graph pool"),
]
BEST_COLOR, PASS_COLOR, FAIL_COLOR, NA_COLOR = "#d62728", "#2ca02c", "#d62728", "#c7c7c7"
PLOT_NAMES = ("throughput_rounds.png", "memory.png", "determinism.png")  # plus throughput_vs_<key>.png
MAX_LINES = 8  # more series than this and a line per combination is unreadable


@dataclass
class Plot:
    path: Path
    title: str
    caption: str


# Labels are swept values and job names, which may hold anything ("$x^$", "a$b"): as text, never
# as mathtext (which raises on most of it). Every Text object reads this when it is created.
PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}


def make_plots(coll: Collection, out_dir: Path) -> list[Plot]:
    with rc_context(PLAIN_TEXT):
        return _make_plots(coll, out_dir)


def _make_plots(coll: Collection, out_dir: Path) -> list[Plot]:
    plots: list[Plot] = []
    if coll.best() is not None:
        for key in coll.swept_keys:
            plots.append(throughput_vs_key(coll, key, out_dir))
        plots.append(throughput_rounds(coll, out_dir))
    for plot in (memory_per_job(coll, out_dir), determinism_per_job(coll, out_dir)):
        if plot is not None:
            plots.append(plot)
    return plots


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_") or "key"


def throughput_vs_key(coll: Collection, key: str, out_dir: Path) -> Plot:
    """Median tokens/s at each value of one swept key (error bars: min-max over rounds); one line
    per combination of the other swept keys, or their best when there are too many."""
    xs = coll.values_of(key)
    others = [k for k in coll.swept_keys if k != key]
    combos = [c for c in product(*(coll.values_of(k) for k in others))
              if any(_matches(j, others, c) for j in coll.ok_jobs)]
    short = short_keys(coll.swept_keys)
    per_line = len(combos) <= MAX_LINES
    if not per_line:
        series = [(f"best over {', '.join(short[k] for k in others)}", lambda j: True)]
    else:  # with one other key its name is the legend's title, so a line is named by its value
        series = [(", ".join(v if len(others) == 1 else f"{short[k]}={v}" for k, v in zip(others, c)) or None,
                   lambda j, c=c: _matches(j, others, c)) for c in combos]
    legend_title = short[others[0]] if len(others) == 1 and per_line else None
    best = coll.best()
    failed_x = sorted({xs.index(j.swept.get(key, MISSING)) for j in coll.problem_jobs})
    fig = Figure(figsize=(15, 4.6))
    axes = fig.subplots(1, 3)
    for ax, (median_key, round_key, name) in zip(axes, THROUGHPUTS):
        top = max([0.0] + [_series_line(ax, coll, key, xs, label, member, median_key, round_key,
                                        best if name == "output" else None)
                           for label, member in series])
        _finish_axis(ax, key, xs, name, top, failed_x, legend_title)
    fig.suptitle(f"Throughput vs {key} (median over rounds, bars: min–max)", fontsize=13)
    fig.tight_layout()
    path = _save(fig, out_dir / f"throughput_vs_{_file_name(key)}.png")
    return Plot(path, f"Throughput vs {key}",
                f"Median tokens/s at each value of {key}"
                + (f", one line per {', '.join(others)}" if others and per_line else "")
                + (f", best over {', '.join(others)}" if others and not per_line else "")
                + "; error bars span the fastest and slowest timed round; the star marks the best job.")


def _series_line(ax, coll: Collection, key: str, xs: list, label, member, median_key: str, round_key: str,
                 best) -> float:
    """One line: the best job of the series at each x (error bars: min-max over its rounds); a
    star on `best` when it is on the line. Returns the line's top (0 when it has no point)."""
    pts = []
    for i, x in enumerate(xs):
        cands = [j for j in coll.ok_jobs if member(j) and j.swept.get(key, MISSING) == x
                 and isinstance(j.get(median_key), (int, float))]
        if cands:
            pts.append((i, max(cands, key=lambda j: j.get(median_key))))
    if not pts:
        return 0.0
    pos = [i for i, _ in pts]
    med = [j.get(median_key) for _, j in pts]
    spreads = [j.spread(round_key) for _, j in pts]
    # clamped: a summary median outside its rounds' range (rounds from another attempt)
    # must not break the plot
    lo = [max(0.0, m - s[0]) if s else 0.0 for m, s in zip(med, spreads)]
    hi = [max(0.0, s[2] - m) if s else 0.0 for m, s in zip(med, spreads)]
    ax.errorbar(pos, med, yerr=[lo, hi], marker="o", capsize=4, label=label and _short(label))
    for p, (_, j) in zip(pos, pts):
        if j is best:
            ax.plot([p], [j.get(median_key)], marker="*", markersize=18, color=BEST_COLOR,
                    linestyle="none", zorder=5, label="best job")
    return max(m + h for m, h in zip(med, hi))


def _finish_axis(ax, key: str, xs: list, name: str, top: float, failed_x: list[int], legend_title) -> None:
    """Failed-job markers, ticks, limits, labels and the legend of one throughput panel."""
    if failed_x:  # where a job failed there is no point: say so instead of leaving a gap
        ax.plot(failed_x, [0] * len(failed_x), marker="x", markersize=10, color=FAIL_COLOR,
                linestyle="none", clip_on=False, zorder=5, label="failed / invalid job")
    ax.set_xticks(range(len(xs)), [_short(x) for x in xs])
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_xlabel(key)
    ax.set_ylabel(f"{name} tokens/s")
    ax.set_title(f"{name.capitalize()} throughput")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(labels):  # the lines first, the markers (best job, failed jobs) after them
        order = sorted(range(len(labels)), key=lambda i: labels[i] in ("best job", "failed / invalid job"))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, title=legend_title,
                  title_fontsize=8, loc="lower right")


def _short(text: object, limit: int = 60) -> str:
    """A label on one line and at most `limit` characters (a swept value may be a whole prompt)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[: limit // 2 - 1]}…{text[-(limit // 2 - 1):]}"


def _matches(job: Job, keys: list[str], values: tuple) -> bool:
    return all(job.swept.get(k, MISSING) == v for k, v in zip(keys, values))


def _height(n_rows: int) -> float:
    return max(2.6, 0.42 * n_rows + 1.4)


def throughput_rounds(coll: Collection, out_dir: Path) -> Plot:
    """Every timed round's output tokens/s per ok job (the spread behind each median)."""
    jobs = [j for j in ranked_jobs(coll) if j.ok][::-1]  # fastest on top
    best = coll.best()
    fig = Figure(figsize=(10, _height(len(jobs))))
    ax = fig.subplots()
    for y, job in enumerate(jobs):
        color = BEST_COLOR if job is best else "#1f77b4"
        vals = job.round_values("throughput/output_tok_s")
        if vals:
            ax.plot([min(vals), max(vals)], [y, y], color=color, alpha=0.4, linewidth=2)
            ax.scatter(vals, [y] * len(vals), color=color, alpha=0.6, s=22,
                       label="one timed round" if y == 0 else None)
        if isinstance(job.get(OUTPUT), (int, float)):
            ax.scatter([job.get(OUTPUT)], [y], marker="|", s=400, color="black", linewidths=2,
                       label="median" if y == 0 else None)
    ax.set_yticks(range(len(jobs)), [_short(f"{job_label(j, coll)}  (job {j.name})") for j in jobs])
    ax.set_xlabel("output tokens/s (generated tokens over round wall time, prefill included)")
    ax.set_title("Total throughput per timed round (best job in red)")
    ax.set_xlim(left=0)
    ax.set_ylim(-0.6, len(jobs) - 0.4)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = _save(fig, out_dir / "throughput_rounds.png")
    return Plot(path, "Throughput per round",
                "Each dot is one timed round (metrics.jsonl), the bar the job's median; a wide spread "
                "means the ranking needs more rounds.")


def _peak(job: Job) -> float | None:
    """The job's peak memory: the allocator's on a GPU, the process's RSS on the CPU."""
    for key in ("memory/peak_allocated_gib", "memory/peak_rss_gib"):
        if isinstance(job.get(key), (int, float)):
            return float(job.get(key))
    return None


def memory_per_job(coll: Collection, out_dir: Path) -> Plot | None:
    kinds = [("peak (allocated on GPU, RSS on CPU)", _peak)] + [
        (label, lambda j, k=key: float(j.get(k)) if isinstance(j.get(k), (int, float)) else None)
        for key, label in MEMORY]
    jobs = [j for j in ranked_jobs(coll) if any(get(j) is not None for _, get in kinds)][::-1]
    kinds = [(label, get) for label, get in kinds if any(get(j) is not None for j in jobs)]
    if not jobs:
        return None
    height = 0.8 / len(kinds)
    fig_height = max(2.8, len(jobs) * (0.16 * len(kinds) + 0.3) + 1.8)
    fig = Figure(figsize=(11, fig_height))
    ax = fig.subplots()
    for i, (label, get) in enumerate(kinds):
        offsets = [y - 0.4 + height * (len(kinds) - 1 - i + 0.5) for y in range(len(jobs))]
        vals = [get(j) or 0.0 for j in jobs]
        bars = ax.barh(offsets, vals, height=height * 0.9, label=label)
        ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in vals], fontsize=7, padding=2)
    ax.set_yticks(range(len(jobs)), [_short(f"{job_label(j, coll)}  (job {j.name})") for j in jobs])
    ax.set_ylim(-0.6, len(jobs) - 0.4)
    ax.set_xlabel("GiB")
    ax.set_title("Memory per job")
    ax.margins(x=0.12)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig_height, 1, 1))  # room for the legend below the axes
    path = _save(fig, out_dir / "memory.png")
    return Plot(path, "Memory per job",
                "Peak memory (the allocator's peak on a GPU, the process's peak RSS on the CPU), "
                "model weights and the paged KV pool, in GiB.")


def determinism_per_job(coll: Collection, out_dir: Path) -> Plot | None:
    """A pass/fail grid: one row per job, one column per determinism check it recorded."""
    checks = determinism_keys(coll)
    if not checks:
        return None
    jobs = ranked_jobs(coll)[::-1]
    fig = Figure(figsize=(max(6.0, 2.2 * len(checks) + 4.5), _height(len(jobs))))
    ax = fig.subplots()
    for y, job in enumerate(jobs):
        for x, key in enumerate(checks):
            v = job.get(key)
            color, text = ((PASS_COLOR, "pass") if v is True else (FAIL_COLOR, "fail") if v is False
                           else (NA_COLOR, job.status if not job.ok else "n/a"))
            ax.add_patch(_cell(x, y, color))
            ax.text(x, y, text, ha="center", va="center", fontsize=9,
                    color="white" if v is not None else "black", fontweight="bold")
    ax.set_xlim(-0.5, len(checks) - 0.5)
    ax.set_ylim(-0.5, len(jobs) - 0.5)
    ax.set_xticks(range(len(checks)), [k.split("/", 1)[1].replace("_", " ") for k in checks])
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(jobs)), [_short(f"{job_label(j, coll)}  (job {j.name})") for j in jobs])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title("Determinism per job (identical tokens when re-run)", pad=28)
    fig.tight_layout()
    path = _save(fig, out_dir / "determinism.png")
    return Plot(path, "Determinism per job",
                "Green: the check passed; red: it failed; grey: not recorded (the job did not finish "
                "ok, or its task does not make that check).")


def _cell(x: int, y: int, color: str) -> Rectangle:
    return Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, facecolor=color, edgecolor="white")
