"""The report's content as plain data: the verdict, the tables, the command line of the best job.

Markdown and HTML render the same tables (render.py), so the numbers cannot disagree.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable

from flexgemma.report.collect import MISSING, Collection, Job, parse_override

TOTAL = "throughput/total_tok_s_median"


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


def job_label(job: Job, coll: Collection) -> str:
    """A job named by its swept values (what the reader compares), else by its directory."""
    if not coll.swept_keys:
        return job.label
    short = short_keys(coll.swept_keys)
    return ", ".join(f"{short[k]}={job.swept.get(k, MISSING)}" for k in coll.swept_keys)


def ranked_jobs(coll: Collection) -> list[Job]:
    """Ok jobs fastest first, then the others in job order."""
    ok = sorted(coll.ok_jobs, key=lambda j: -(_num(j.get(TOTAL)) or float("-inf")))
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
        Column("total tok/s (median)", lambda j: fmt_rate(j.get(TOTAL))),
        Column("total tok/s min – max (rounds)", lambda j: _spread_cell(j, "throughput/total_tok_s")),
        Column("decode tok/s", lambda j: fmt_rate(j.get("throughput/decode_tok_s_median"))),
        Column("decode tok/s min – max", lambda j: _spread_cell(j, "throughput/decode_tok_s")),
        Column("prefill tok/s", lambda j: fmt_rate(j.get("throughput/prefill_tok_s_median"))),
        Column("TTFT p50 ms", lambda j: fmt_ms(j.get("latency/ttft_p50_ms"))),
        Column("TPOT p50 ms", lambda j: fmt_ms(j.get("latency/tpot_p50_ms"))),
    ]
    return _build("Throughput and latency", coll, columns,
                  note="Medians over the timed rounds; min – max is the spread over those rounds "
                       "(from metrics.jsonl). TTFT: time to first token; TPOT: time per output token.")


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
    command: str | None


def verdict(coll: Collection) -> Verdict:
    counts = _status_counts(coll)
    best = coll.best()
    if best is None:
        why = "none has a total tokens/s" if coll.ok_jobs else "none finished with status ok"
        return Verdict(f"No best configuration: {len(coll.jobs)} job(s), {why} ({counts}).",
                       ["The errors are listed under “Failed, invalid and incomplete jobs”."], None)
    speed = f"{fmt_rate(best.get(TOTAL))} total tok/s"
    rounds = best.get("bench/rounds")
    speed += f" (median of {rounds} round{'s' if rounds != 1 else ''})" if rounds else " (median)"
    what = job_label(best, coll) if coll.swept_keys else f"job {best.name}"
    others = [j for j in ranked_jobs(coll) if j.ok and j is not best and _num(j.get(TOTAL))]
    if others:
        slowest = min(others, key=lambda j: j.get(TOTAL))
        speed += f", {best.get(TOTAL) / slowest.get(TOTAL):.2f}× the slowest ({fmt_rate(slowest.get(TOTAL))})"
    headline = f"Best: {what} (job {best.name}) at {speed}; {counts}."
    notes = []
    if others:
        runner = others[0]
        b, r = best.spread("throughput/total_tok_s"), runner.spread("throughput/total_tok_s")
        gap = 100 * (best.get(TOTAL) - runner.get(TOTAL)) / best.get(TOTAL)
        note = f"Runner-up: {job_label(runner, coll)} (job {runner.name}), {gap:.1f}% slower."
        if b and r and r[2] >= b[0]:
            note += (" Their round-to-round ranges overlap, so the order may be noise: "
                     "re-run both with more rounds (workload.rounds=N) before trusting it.")
        notes.append(note)
    else:
        notes.append("Only one job finished ok: there is nothing to compare it with.")
    if best.get("determinism/run_to_run") is False:
        notes.append("Warning: the best job is not deterministic run to run.")
    return Verdict(headline, notes, command_line(best, coll))


def _status_counts(coll: Collection) -> str:
    counts: dict[str, int] = {}
    for j in coll.jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    order = ["ok", "failed", "invalid", "incomplete"]
    keys = sorted(counts, key=lambda s: (order.index(s) if s in order else len(order), s))
    return ", ".join(f"{counts[s]} {s}" for s in keys)
