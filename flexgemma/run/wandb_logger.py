"""Weights & Biases logging of one job, through the real `wandb` library.

The `logger` group picks the mode: `wandb_offline` (the default: the run is written under the
job's own directory, `<job dir>/wandb/offline-run-*`, and can be uploaded later with
`wandb sync`), `wandb_online`, or `none`. The names logged are the flat `group/name` keys of
summary.json (see flexgemma/run/metrics.py); per-round rows are the rows of metrics.jsonl.

`read_offline_run` reads a run back with wandb's own reader (`wandb leet inspect`), which the
tests use to check what was logged.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("flexgemma")

_MODES = {"wandb_offline": "offline", "wandb_online": "online"}
_MAX_TAG_LEN = 64  # W&B rejects longer tags


def logger_kind(cfg: DictConfig) -> str:
    kind = OmegaConf.select(cfg, "logger.kind", default="none")
    return str(getattr(kind, "value", kind))


class WandbRun:
    """One W&B run per job: started before the engine is built, always finished (also on failure)."""

    def __init__(self, run, saved_env: Optional[dict] = None):
        self.run = run
        self._saved_env = saved_env or {}  # W&B's directory variables as they were before this run

    @classmethod
    def start(cls, cfg, out_dir: Path, identity: dict[str, Any],
              environment: dict[str, Any]) -> Optional["WandbRun"]:
        """`cfg` the composed config (DictConfig) or the typed one (flexgemma.config.compose)."""
        cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
        kind = logger_kind(cfg)
        if kind not in _MODES:
            return None
        try:
            import wandb
        except ImportError:
            from flexgemma.config.extras import install_hint

            log.warning("logger=%s but wandb is not installed (%s): the job goes on without W&B and is recorded "
                        "in %s; logger=none silences this.", kind, install_hint("wandb"), out_dir)
            return None

        # the job prints its own table and where the run is; W&B's banner, hints, warnings and run
        # summary would bury it (WANDB_SILENT=false brings them back)
        os.environ.setdefault("WANDB_SILENT", "true")
        saved = {}
        if _MODES[kind] == "offline":
            keep_offline()
            saved = inside_job_dir(out_dir)
        config = {"config": _resolved(cfg), "env": environment, "choices": identity.get("choices", {}),
                  "overrides": identity.get("overrides", [])}
        tags = [t[:_MAX_TAG_LEN] for t in identity.get("tags", [])] + [str(t) for t in cfg.logger.get("tags", [])]
        try:
            entity = cfg.logger.get("entity")
            run = wandb.init(
                project=str(cfg.logger.project), entity=str(entity) if entity else None, group=identity.get("group"),
                job_type=identity.get("job_type"), name=identity.get("name"), tags=tags, config=config,
                mode=_MODES[kind], dir=str(out_dir),
                reinit="finish_previous",  # a job that runs in the sweep's process closes the previous job's run
            )
        except Exception as e:  # noqa: BLE001 - the job's own files still record it; say how to get W&B back
            log.error("W&B (logger=%s) could not start a run: %s. The job goes on and is recorded in %s; "
                      "use logger=wandb_offline and `wandb sync` later, or logger=none.", kind, e, out_dir)
            restore_env(saved)
            return None
        return cls(run, saved)

    @property
    def where(self) -> str:
        """The run's directory (offline: upload it with `wandb sync DIR`) or its URL."""
        return str(Path(self.run.dir).parent) if self.run.offline else str(self.run.url)

    def log_round(self, row: dict[str, Any]) -> None:
        self.run.log(row)

    def log_completions(self, rows: list[dict[str, Any]]) -> None:
        """The completions as a wandb.Table (one row a completion), browsable in the W&B UI."""
        import wandb

        columns = ["prompt_index", "sample", "prompt", "completion", "finish_reason", "prompt_tokens", "tokens"]
        data = [[r.get("prompt_index"), r.get("sample", 0), str(r.get("prompt", "")), str(r.get("completion", r.get("token_ids"))),
                 r.get("finish_reason"), r.get("prompt_tokens"), len(r.get("token_ids") or [])] for r in rows]
        try:
            self.run.log({"completions": wandb.Table(columns=columns, data=data)})
        except Exception as e:  # noqa: BLE001 - completions.jsonl holds them anyway
            log.warning("W&B could not take the completions table: %s", e)

    def set_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def finish(self, status: str, files: Sequence[Path] = ()) -> None:
        """Attaches the job's record files (uploaded with the run) and finishes it with the exit code a
        process would report: 0 ok, 2 invalid configuration, 1 failed."""
        for path in files:
            if path.is_file():
                try:
                    self.run.save(str(path), base_path=str(path.parent), policy="now")
                except Exception as e:  # noqa: BLE001 - a file W&B cannot take must not lose the run
                    log.warning("W&B could not attach %s: %s", path, e)
        try:
            self.run.finish(exit_code={"ok": 0, "invalid": 2}.get(status, 1))
        finally:
            restore_env(self._saved_env)


# wandb's own directories outside the run's: staged table/artifact files (~/.local/share/wandb),
# artifact cache and wandb-core's logs (~/.cache/wandb). An offline run keeps them in its job directory.
_LOCAL_DIRS = {"WANDB_DATA_DIR": "data", "WANDB_CACHE_DIR": "cache", "WANDB_ARTIFACT_DIR": "artifacts"}


def inside_job_dir(out_dir: Path) -> dict[str, Optional[str]]:
    """Points wandb's staging, cache and artifact directories into <out_dir>/wandb; returns the previous
    values for restore_env (a sweep may run several jobs in one process)."""
    saved = {k: os.environ.get(k) for k in _LOCAL_DIRS}
    for key, sub in _LOCAL_DIRS.items():
        os.environ[key] = str(Path(out_dir).resolve() / "wandb" / sub)
    return saved


def restore_env(saved: dict[str, Optional[str]]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def keep_offline() -> None:
    """No network from an offline run. wandb 0.31 writes the run locally in offline mode, but its own
    usage analytics (OpenTelemetry, through a process-wide proxy built from wandb's global settings,
    not the run's mode) still resolve and contact api.forge.coreweave.com. WANDB_ERROR_REPORTING=false
    turns that recorder off in this process and starts wandb-core with --no-observability; disable()
    stops the process's analytics proxy outright. Verified with strace (tests/test_hostile.py): no
    AF_INET/AF_INET6 connect from this process, wandb-core or wandb-symon. A user's explicit
    WANDB_ERROR_REPORTING is kept."""
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        from wandb.analytics.opentelemetry import opentelemetry_proxy

        opentelemetry_proxy.disable()
    except (ImportError, AttributeError):  # another wandb version: the variable above still applies
        log.debug("wandb has no opentelemetry_proxy.disable(); relying on WANDB_ERROR_REPORTING=false")


def _resolved(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation that fails is the job's error, not the logger's
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


# -- reading runs back ---------------------------------------------------------------------------
def offline_runs(job_dir: str | Path) -> list[Path]:
    """The offline W&B run directories of a job, oldest first."""
    return sorted(Path(job_dir).glob("wandb/offline-run-*"))


def read_offline_run(run_dir: str | Path) -> dict[str, Any]:
    """What a run holds, read with wandb's own reader of the .wandb log (`wandb leet inspect`):
    {"summary", "config", "tags", "name", "state", "exit_code", "group", "job_type", "history"}."""
    run_dir = Path(run_dir)
    summary = json.loads(_inspect(run_dir, "--summary", "--json"))
    out = {k: summary.get(k) for k in ("summary", "config", "tags", "name", "state", "exit_code", "project")}
    out["history"] = []
    for line in _inspect(run_dir, "--json").splitlines():
        rec = json.loads(line)
        if rec.get("type") == "run":
            out["group"] = rec["run"].get("run_group")
            out["job_type"] = rec["run"].get("job_type")
        elif rec.get("type") == "history":
            out["history"].append({k: v for k, v in rec["history"]["item"].items() if not k.startswith("_")})
    return out


def _inspect(run_dir: Path, *flags: str) -> str:
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(run_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout
