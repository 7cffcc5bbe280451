"""The report's content as plain data: the verdict, the tables, the command line of the best job.

Markdown and HTML render the same tables (render.py), so the numbers cannot disagree.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable

from flexgemma.report.collect import MISSING, Collection, Job, parse_override
from flexgemma.report.noise import Group, groups, inert_keys, live_keys, noise

OUTPUT = "throughput/output_tok_s_median"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    jobs: list[Job]  # the job of each row
    numeric: list[bool]  # right-aligned columns
    best_row: int | None
    note: str = ""


@dataclass
class Column:
    header: str
    cell: Callable[[Job], str]
    numeric: bool = True


def fmt_rate(v: Any) -> str:
    v = _num(v)
    return MISSING if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}")


def fmt_ms(v: Any) -> str:
    v = _num(v)
    return MISSING if v is None else (f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}")


def fmt_gib(v: Any) -> str:
    v = _num(v)
    if v is None:
        return MISSING
    return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_seconds(v: Any) -> str:
    v = _num(v)
    return MISSING if v is None else f"{v:,.2f}"


def fmt_pct(v: Any) -> str:
    v = _num(v)
    return MISSING if v is None else f"{v:.1f}"


def fmt_bandwidth(job: Job) -> str:
    """A job's decode GB/s with its share of the GPU's peak where the job knew the peak (the roofline)."""
    gb, pct = _num(job.get("bandwidth/decode_gb_s_median")), _num(job.get("bandwidth/decode_pct_of_peak_median"))
    if gb is None:
        return MISSING
    return f"{gb:,.0f} ({pct:.0f}%)" if pct is not None else f"{gb:,.0f}"


def fmt_check(v: Any) -> str:
    return {True: "pass", False: "fail"}.get(v, MISSING) if isinstance(v, bool) else MISSING


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def short_keys(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix that still tells the keys apart: attn.decode.block_n -> block_n,
    but decode.block_n / prefill.block_n when both were swept."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(o != key and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        out[key] = suffix
    return out


def job_label(job: Job, coll: Collection, keys: list[str] | None = None) -> str:
    """A job named by its swept values (what the reader compares; `keys`: only those), else by its
    directory."""
    keys = coll.swept_keys if keys is None else keys
    if not keys:
        return job.label
    short = short_keys(keys)
    return ", ".join(f"{short[k]}={job.swept.get(k, MISSING)}" for k in keys)


def ranked_jobs(coll: Collection) -> list[Job]:
    """Ok jobs fastest first, then the others in job order."""
    ok = sorted(coll.ok_jobs, key=lambda j: -(_num(j.get(OUTPUT)) or float("-inf")))
    return ok + coll.problem_jobs


def _spread_cell(job: Job, key: str) -> str:
    s = job.spread(key)
    if s is None:
        return MISSING
    lo, _, hi = s
    return f"{fmt_rate(lo)} – {fmt_rate(hi)} ({len(job.round_values(key))})"


def _peak_memory(job: Job) -> tuple[float | None, str]:
    if _num(job.get("memory/peak_allocated_gib")) is not None:
        return job.get("memory/peak_allocated_gib"), "allocated"
    if _num(job.get("memory/peak_rss_gib")) is not None:
        return job.get("memory/peak_rss_gib"), "RSS"
    return None, ""


def _key_columns(coll: Collection) -> list[Column]:
    return [Column(k, lambda j, k=k: j.swept.get(k, MISSING), numeric=False) for k in coll.swept_keys]


def _build(title: str, coll: Collection, columns: list[Column], note: str = "") -> Table:
    jobs = ranked_jobs(coll)
    best = coll.best()
    ranks = {id(j): i + 1 for i, j in enumerate(j for j in jobs if j.ok)}
    head = [Column("rank", lambda j: str(ranks.get(id(j), MISSING))),
            Column("job", lambda j: j.name, numeric=False)]
    cols = head + _key_columns(coll) + [Column("status", lambda j: j.status, numeric=False)] + columns
    return Table(title=title, headers=[c.header for c in cols], rows=[[c.cell(j) for c in cols] for j in jobs],
                 jobs=jobs, numeric=[c.numeric for c in cols],
                 best_row=next((i for i, j in enumerate(jobs) if j is best), None), note=note)


def throughput_table(coll: Collection) -> Table:
    columns = [
        Column("output tok/s (median)", lambda j: fmt_rate(j.get(OUTPUT))),
        Column("output tok/s min – max (rounds)", lambda j: _spread_cell(j, "throughput/output_tok_s")),
        Column("decode tok/s", lambda j: fmt_rate(j.get("throughput/decode_tok_s_median"))),
        Column("decode tok/s min – max", lambda j: _spread_cell(j, "throughput/decode_tok_s")),
        Column("prefill tok/s", lambda j: fmt_rate(j.get("throughput/prefill_tok_s_median"))),
        Column("TTFT p50 ms", lambda j: fmt_ms(j.get("latency/ttft_p50_ms"))),
        Column("TPOT p50 ms", lambda j: fmt_ms(j.get("latency/tpot_p50_ms"))),
        Column("decode GB/s (% of peak)", fmt_bandwidth),
    ]
    return _build("Throughput and latency", coll, columns,
                  note="Medians over the timed rounds; min – max is the spread over those rounds "
                       "(from metrics.jsonl). TTFT: time to first token; TPOT: time per output token. Decode "
                       "GB/s: the bytes a decode step must read (the weights, for MoE models the experts its "
                       "rows route to, and every live sequence's K and V) over the step's time, and its share "
                       "of the GPU's peak bandwidth: how close decode runs to the memory roofline.")


def resources_table(coll: Collection) -> Table:
    kinds = {_peak_memory(j)[1] for j in coll.jobs} - {""}
    if kinds == {"allocated"}:
        peak_header, peak = "peak allocated GiB", lambda j: fmt_gib(_peak_memory(j)[0])
    elif kinds == {"RSS"}:
        peak_header, peak = "peak RSS GiB", lambda j: fmt_gib(_peak_memory(j)[0])
    else:  # GPU and CPU jobs side by side: say which is which in the cell
        peak_header = "peak GiB"
        peak = lambda j: (f"{fmt_gib(_peak_memory(j)[0])} ({_peak_memory(j)[1]})"  # noqa: E731
                          if _peak_memory(j)[0] is not None else MISSING)
    columns = [
        Column(peak_header, peak),
        Column("KV pool GiB", lambda j: fmt_gib(j.get("memory/kv_pool_gib"))),
        Column("build s", lambda j: fmt_seconds(j.get("build/seconds"))),
    ]
    for key in determinism_keys(coll):
        columns.append(Column("determinism: " + key.split("/", 1)[1].replace("_", " "), lambda j, k=key: fmt_check(j.get(k)),
                              numeric=False))
    if any(j.get("parity/token_match_pct") is not None for j in coll.jobs):
        columns.append(Column("parity token match %", lambda j: fmt_pct(j.get("parity/token_match_pct"))))
    return _build("Memory, build time and correctness", coll, columns,
                  note="Peak memory is the allocator's peak on a GPU and the process's peak RSS on the "
                       "CPU. Determinism: identical tokens across runs (pass/fail).")


def determinism_keys(coll: Collection) -> list[str]:
    keys = {k for j in coll.jobs for k, v in j.summary.items() if k.startswith("determinism/") and isinstance(v, bool)}
    # run-to-run first: it is the check every bench job makes
    return sorted(keys, key=lambda k: (k != "determinism/run_to_run", k))


def problems_table(coll: Collection) -> Table | None:
    jobs = coll.problem_jobs
    if not jobs:
        return None
    headers = ["job", *coll.swept_keys, "status", "error", "directory"]
    rows = [[j.name, *(j.swept.get(k, MISSING) for k in coll.swept_keys), j.status,
             _one_line(j.error or ""), str(j.dir)] for j in jobs]
    return Table(title="Failed, invalid and incomplete jobs", headers=headers, rows=rows, jobs=jobs,
                 numeric=[False] * len(headers), best_row=None)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def command_line(job: Job, coll: Collection) -> str:
    """The command that re-runs a job: its overrides as Hydra recorded them, shell-quoted."""
    if job.overrides is not None:
        args = [o for o in job.overrides if not parse_override(o)[0].startswith("hydra.")]
    else:  # no Hydra record: rebuild from the swept keys (the rest is in its config_resolved.yaml)
        args = [f"{k}={v}" for k, v in job.swept.items() if v != MISSING]
    return " ".join(["python -m flexgemma", *(shlex.quote(a) for a in args)])


@dataclass
class Verdict:
    headline: str
    notes: list[str]
    command: str | None  # None when no configuration is crowned (nothing ok, inert keys, noise)
    best: Job | None = None  # the crowned configuration's fastest job


def verdict(coll: Collection) -> Verdict:
    """Crowns the fastest configuration only when a swept key that the runs read explains the
    difference and, where repeated jobs measured the noise, the difference exceeds it."""
    counts = _status_counts(coll)
    if coll.best() is None:
        why = "none has a output tokens/s" if coll.ok_jobs else "none finished with status ok"
        return Verdict(f"No best configuration: {len(coll.jobs)} job(s), {why} ({counts}).",
                       ["The errors are listed under “Failed, invalid and incomplete jobs”."], None)
    inert = inert_keys(coll)
    live = live_keys(coll, inert)
    notes = [f"`{k}` is inert: it has no effect in these runs ({why}), so no value of it is better "
             "than another." for k, why in inert.items()]
    gs = groups(coll, live)
    measured = noise(gs)
    if coll.swept_keys and not live:
        return _no_live_key(coll, gs, measured, counts, notes)
    top, runner = gs[0], (gs[1] if len(gs) > 1 else None)
    speed = _group_speed(top, coll)
    if gs[1:]:
        speed += f", {top.total / gs[-1].total:.2f}× the slowest ({fmt_rate(gs[-1].total)})"
    what = job_label(top.jobs[0], coll, live) if live else f"job {top.jobs[0].name}"
    if runner is None:
        notes.append("Only one job finished ok: there is nothing to compare it with." if len(coll.ok_jobs) == 1
                     else "Only one configuration finished ok: there is nothing to compare it with.")
    else:
        gap = 100 * (top.total - runner.total) / top.total
        label = f"{job_label(runner.jobs[0], coll, live)} ({_jobs_text(runner)})"
        if measured is not None and gap <= 100 * measured[0]:
            return _within_noise(top, runner, gap, measured, counts, coll, live, notes)
        notes.append(_runner_note(top, runner, gap, label, measured))
    if top.jobs[0].get("determinism/run_to_run") is False:
        notes.append("Warning: the best job is not deterministic run to run.")
    return Verdict(f"Best: {what} ({_jobs_text(top)}) at {speed}; {counts}.", notes,
                   command_line(top.jobs[0], coll), top.jobs[0])


def _jobs_text(group: Group) -> str:
    names = [j.name for j in group.jobs]
    return f"job {names[0]}" if len(names) == 1 else f"jobs {', '.join(names)}"


def _group_speed(group: Group, coll: Collection) -> str:
    speed = f"{fmt_rate(group.total)} output tok/s"
    if len(group.jobs) > 1:
        return speed + f" (median of {len(group.jobs)} repeated jobs' medians)"
    rounds = group.jobs[0].get("bench/rounds")
    return speed + (f" (median of {rounds} round{'s' if rounds != 1 else ''})" if rounds else " (median)")


def _runner_note(top: Group, runner: Group, gap: float, label: str, measured: tuple[float, int] | None) -> str:
    note = f"Runner-up: {label}, {gap:.1f}% slower."
    if measured is not None:
        return note + (f" That is more than the {100 * measured[0]:.1f}% spread between repeated jobs "
                       f"({measured[1]} jobs).")
    b, r = top.jobs[0].spread("throughput/output_tok_s"), runner.jobs[0].spread("throughput/output_tok_s")
    if b and r and r[2] >= b[0]:
        note += (" Their round-to-round ranges overlap, so the order may be noise: "
                 "re-run both with more rounds (workload.rounds=N) before trusting it.")
    return note + (" No configuration ran more than once, so the job-to-job noise is unknown: "
                   "add a repeat axis (+repeat=0,1,2) to measure it.")


def _within_noise(top: Group, runner: Group, gap: float, measured: tuple[float, int], counts: str,
                  coll: Collection, live: list[str], notes: list[str]) -> Verdict:
    head = (f"Within noise: the fastest configuration, {job_label(top.jobs[0], coll, live)} "
            f"({fmt_rate(top.total)} output tok/s), is {gap:.1f}% ahead of "
            f"{job_label(runner.jobs[0], coll, live)} ({fmt_rate(runner.total)}), no more than the "
            f"{100 * measured[0]:.1f}% spread between repeated jobs ({measured[1]} jobs); {counts}.")
    notes.append("No configuration is crowned. Add repeats (+repeat=0,1,2,...) or rounds "
                 "(workload.rounds=N) to tell them apart.")
    return Verdict(head, notes, None)


def _no_live_key(coll: Collection, gs: list[Group], measured: tuple[float, int] | None, counts: str,
                 notes: list[str]) -> Verdict:
    (only,) = gs  # every ok job is the same configuration
    spread = f", {100 * measured[0]:.1f}% apart" if measured else ""
    head = (f"No best configuration: the jobs differ only in inert or repeat keys "
            f"({', '.join(coll.swept_keys)}), so they ran one configuration: {fmt_rate(only.total)} output "
            f"tok/s, the median of {len(only.jobs)} job(s){spread}; {counts}.")
    notes.append("Their differences in speed are noise, not an effect of the swept values.")
    return Verdict(head, notes, None)


def _status_counts(coll: Collection) -> str:
    counts: dict[str, int] = {}
    for j in coll.jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    order = ["ok", "failed", "invalid", "incomplete"]
    keys = sorted(counts, key=lambda s: (order.index(s) if s in order else len(order), s))
    return ", ".join(f"{counts[s]} {s}" for s in keys)
