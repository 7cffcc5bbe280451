"""Finds the jobs below the report's directories and reads what each one recorded.

A job is a directory holding `summary.json` (a finished, failed or invalid job), or one that holds
only Hydra's `.hydra/overrides.yaml` / flexgemma's `config_resolved.yaml` (a job that was killed
or is still running: it has no summary yet and is listed as `incomplete`).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Directories that hold copies of a job's files (W&B run folders) or Hydra's own records.
_SKIP_PARTS = {"wandb", ".hydra"}
MISSING = "—"  # shown for a key a job did not set (it ran with the default)


class ReportError(Exception):
    """The report cannot be built (no such directory, no jobs); the message says why."""


@dataclass
class Job:
    dir: Path
    label: str  # the directory relative to the DIR it was found under
    number: int | None  # Hydra's job number (the `N_` prefix of a sweep subdir)
    status: str
    summary: dict[str, Any]
    error: str | None
    overrides: list[str] | None  # as written in .hydra/overrides.yaml (exactly what was typed)
    config: dict[str, Any] | None  # config_resolved.yaml, flattened to dotted keys
    rounds: list[dict[str, Any]]  # metrics.jsonl rows of the timed rounds (last attempt)
    swept: dict[str, str] = field(default_factory=dict)  # swept key -> value as typed
    unreadable: list[str] = field(default_factory=list)  # "<file>[:line]: why" of each file left out

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def name(self) -> str:
        return str(self.number) if self.number is not None else self.label

    def get(self, key: str) -> Any:
        return self.summary.get(key)

    def round_values(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.rounds if isinstance(r.get(key), (int, float))]

    def spread(self, key: str) -> tuple[float, float, float] | None:
        """(min, median, max) of a per-round metric, None without per-round data."""
        vals = self.round_values(key)
        if not vals:
            return None
        return min(vals), statistics.median(vals), max(vals)


@dataclass
class Collection:
    roots: list[Path]
    jobs: list[Job]
    swept_keys: list[str]
    swept_from: str  # "overrides" (Hydra's record) or "config" (config_resolved.yaml diff) or "none"

    @property
    def ok_jobs(self) -> list[Job]:
        return [j for j in self.jobs if j.ok]

    @property
    def problem_jobs(self) -> list[Job]:
        return [j for j in self.jobs if not j.ok]

    @property
    def unreadable(self) -> list[str]:
        """One line for each job file the report could not read (and so left out)."""
        return [line for j in self.jobs for line in j.unreadable]

    def best(self) -> Job | None:
        """The ok job with the highest median output tokens/s."""
        scored = [j for j in self.ok_jobs if _number(j.get("throughput/output_tok_s_median")) is not None]
        return max(scored, key=lambda j: j.get("throughput/output_tok_s_median"), default=None)

    def values_of(self, key: str) -> list[str]:
        """The distinct values a swept key took, in natural order (numbers by value)."""
        return sorted({j.swept.get(key, MISSING) for j in self.jobs}, key=value_sort_key)


def collect(dirs: list[str | Path]) -> Collection:
    roots = [Path(d) for d in dirs]
    for root in roots:
        if not root.is_dir():
            raise ReportError(f"{root} is not a directory (give a Hydra sweep dir or run dirs)")
    seen: set[Path] = set()
    jobs: list[Job] = []
    for root in roots:
        for job_dir in _job_dirs(root):
            if job_dir.resolve() in seen:  # nested DIRs name the same job twice
                continue
            seen.add(job_dir.resolve())
            jobs.append(_read_job(root, job_dir))
    if not jobs:
        raise ReportError(f"no jobs found under {', '.join(map(str, roots))}: no summary.json, "
                          ".hydra/overrides.yaml or config_resolved.yaml below them")
    jobs.sort(key=lambda j: (j.number is None, j.number if j.number is not None else 0, j.label))
    keys, source = _find_swept(jobs)
    return Collection(roots=roots, jobs=jobs, swept_keys=keys, swept_from=source)


def _job_dirs(root: Path) -> list[Path]:
    markers = ("summary.json", "config_resolved.yaml", ".hydra/overrides.yaml")
    found = set()
    for marker in markers:
        for path in root.rglob(marker):
            job_dir = path.parent.parent if marker.startswith(".hydra") else path.parent
            if _SKIP_PARTS.intersection(job_dir.relative_to(root).parts):
                continue
            found.add(job_dir)
    return sorted(found)


def _read_job(root: Path, job_dir: Path) -> Job:
    label = job_dir.relative_to(root).as_posix()
    label = root.name if label == "." else label
    m = re.match(r"(\d+)(_|$)", job_dir.name)
    summary, status, error = _read_summary(job_dir)
    notes: list[str] = []
    job = Job(dir=job_dir, label=label, number=int(m.group(1)) if m else None, status=status,
              summary=summary, error=error, overrides=_read_overrides(job_dir, notes),
              config=_read_config(job_dir, notes), rounds=_read_rounds(job_dir, notes))
    job.unreadable = notes
    return job


def _why(e: BaseException) -> str:
    """A read or parse error as a few words (a RecursionError's own text names no file or depth)."""
    if isinstance(e, RecursionError):
        return "nested too deeply to read"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte {e.start})"
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _read_text(path: Path, notes: list[str]) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError) as e:
        notes.append(f"{path}: {_why(e)}; left out")
        return None


def _read_summary(job_dir: Path) -> tuple[dict, str, str | None]:
    path = job_dir / "summary.json"
    if not path.exists():
        return {}, "incomplete", "no summary.json: the job is still running or was killed"
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as e:
        return {}, "unreadable", f"summary.json cannot be read: {_why(e)}"
    status = str(summary.get("status") or "unknown")
    error = None
    if status != "ok":
        error = summary.get("error") or _last_line(summary.get("traceback")) or "(no error recorded)"
    return summary, status, error


def _last_line(text: Any) -> str | None:
    lines = [ln for ln in str(text or "").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None


_UNREAD = object()  # _read_yaml: no such file, or not readable YAML


def _read_yaml(path: Path, notes: list[str]) -> Any:
    """The YAML in `path`; _UNREAD when there is none or it is not readable (a note names the file)."""
    text = _read_text(path, notes) if path.exists() else None
    if text is None:
        return _UNREAD
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        notes.append(f"{path}: {_why(e)}; left out")
        return _UNREAD


def _read_overrides(job_dir: Path, notes: list[str]) -> list[str] | None:
    data = _read_yaml(job_dir / ".hydra" / "overrides.yaml", notes)
    if data is _UNREAD:
        return None
    data = data or []  # an empty file: no overrides
    return [str(x) for x in data] if isinstance(data, list) else None


def _read_config(job_dir: Path, notes: list[str]) -> dict[str, Any] | None:
    data = _read_yaml(job_dir / "config_resolved.yaml", notes)
    return flatten(data) if isinstance(data, dict) else None


def _read_rounds(job_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    path = job_dir / "metrics.jsonl"
    text = _read_text(path, notes) if path.exists() else None
    if text is None:
        return []
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed job
        except RecursionError as e:
            notes.append(f"{path}:{lineno}: {_why(e)}; left out")
            continue
        if isinstance(row, dict) and "throughput/output_tok_s" in row:
            rows.append(row)
    # metrics.jsonl is appended to, so a re-run job holds several attempts: keep the last one,
    # which is the attempt its summary.json describes (a new attempt starts where the round
    # number stops increasing).
    start = 0
    for i in range(1, len(rows)):
        if not _round_no(rows[i]) > _round_no(rows[i - 1]):
            start = i
    return rows[start:]


def _round_no(row: dict) -> float:
    r = row.get("round")
    return float(r) if isinstance(r, (int, float)) else float("inf")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, str]:
    """`+attn.decode.block_n=32` -> ("attn.decode.block_n", "32"); `~key` -> ("key", "(deleted)")."""
    if text.startswith("~"):
        key, _, value = text[1:].partition("=")
        return key, "(deleted)"
    key, _, value = text.lstrip("+").partition("=")
    return key, value


def _find_swept(jobs: list[Job]) -> tuple[list[str], str]:
    """Sets job.swept for every job and returns the swept keys in a stable order."""
    if all(j.overrides is not None for j in jobs):
        per_job = [dict(parse_override(o) for o in j.overrides) for j in jobs]
        per_job = [{k: v for k, v in d.items() if not k.startswith("hydra.")} for d in per_job]
        source = "overrides"
    elif any(j.config is not None for j in jobs):
        per_job = [_config_view(j) for j in jobs]
        source = "config"
    else:
        return [], "none"
    ordered: list[str] = []  # first appearance order: the order the user typed the overrides
    for d in per_job:
        ordered += [k for k in d if k not in ordered]
    swept = [k for k in ordered if len({d.get(k, MISSING) for d in per_job}) > 1]
    if source == "config":
        swept = _drop_explained_by_choices(swept)
    for job, d in zip(jobs, per_job):
        job.swept = {k: d.get(k, MISSING) for k in swept}
    return swept, source if swept else "none"


def _config_view(job: Job) -> dict[str, str]:
    view = {k: _as_text(v) for k, v in (job.config or {}).items()}
    # the group choices (model=e2b, cudagraph=ladder16) name what a run picked more briefly
    # than the dozens of keys that choice changes
    for group, choice in (job.summary.get("choices") or {}).items():
        view[str(group)] = _as_text(choice)
    return view


def _drop_explained_by_choices(swept: list[str]) -> list[str]:
    """Drops `model.hf_config.x` when `model` itself differs: the choice explains them."""
    groups = {k for k in swept if "." not in k}
    return [k for k in swept if k in groups or k.split(".")[0] not in groups]


def _as_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def typed_value(text: str) -> Any:
    """A swept value as a number where it is one (for ordering and numeric axes)."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else text


def value_sort_key(text: str) -> tuple:
    """Default first, then numbers by value, then text in natural order (ladder8 < ladder16)."""
    if text == MISSING:
        return (0, 0.0, ())
    v = typed_value(text)
    if isinstance(v, (int, float)):
        return (1, float(v), ())
    chunks = re.split(r"(\d+)", text)
    return (2, 0.0, tuple((0, int(c), "") if c.isdigit() else (1, 0, c) for c in chunks))


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
