"""One job: type the config, build the engine, run the task on the workload, record and print the
results.

`hydra_task` is the Hydra task function of `python -m flexgemma` (a single run, and every job of
a multirun); `run_job` is the job itself and needs no Hydra. The config is typed once, inside the
job (so an invalid one is recorded as such); the engine and the tasks read the typed Config.

A job ends in one of three states, written to its summary.json (and its W&B run):
`ok`; `invalid` (a ConfigError: the configuration composes but cannot run, e.g. a sweep point
with a block size the kernels reject); `failed` (any other error, with its message and traceback).
In a single run `invalid` exits with code 2 and `failed` re-raises; in a multirun both are
recorded and the sweep goes on.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from flexgemma.builder import build_engine
from flexgemma.config.compose import ensure_model
from flexgemma.config.schema import Config, ConfigError, validate
from flexgemma.tasks import bench, determinism, drift, grpo, parity
from flexgemma.tasks.common import bounded
from flexgemma.run.joblock import JobLock, JobLockedError
from flexgemma.rl import ranks
from flexgemma.run.tracking import RunRecorder, environment, format_table, read_summary, unwritable
from flexgemma.run.wandb_logger import WandbRun
from flexgemma.tasks.workload import build_workload, check_workload, pool_demand

log = logging.getLogger("flexgemma")

MAX_ERROR_CHARS = 20_000  # an error quoting a huge input must not make summary.json huge

TASKS = {
    "bench": [bench], "parity": [parity], "determinism": [determinism], "drift": [drift], "grpo": [grpo],
    "all": [bench, determinism, parity],
}


def task_name(cfg) -> str:
    return str(getattr(cfg.task.name, "value", cfg.task.name))


def run_job(cfg: Config | DictConfig, out_dir: str | Path, identity: Optional[dict] = None,
            raise_errors: bool = True) -> dict:
    """Runs cfg.task into out_dir (summary.json, metrics.jsonl, config_resolved.yaml, W&B run). `cfg`:
    the typed Config (flexgemma.config.compose), or a composed DictConfig (Hydra's), typed inside the job.

    raise_errors: re-raise the job's error after recording it (a single run); False returns the
    summary with status invalid/failed instead (a sweep job). Raises JobLockedError, touching
    nothing, when another live process runs a job in out_dir."""
    typed = cfg if isinstance(cfg, Config) else None
    cfg = OmegaConf.structured(cfg) if typed is not None else ensure_model(cfg)  # what the records hold
    out_dir = Path(out_dir)
    w = ranks.world()
    if w.size > 1:  # torchrun / accelerate launch: rank 0 alone writes the records (docs/grpo.md)
        ranks.check_task(task_name(cfg), w)
        ranks.use_rank_device(w)
        if not w.is_main:
            return _run_locked(cfg, typed, out_dir, identity, raise_errors, ranks.NullRecorder(cfg))
    lock = JobLock(out_dir)
    try:
        lock.acquire()
    except OSError as e:  # JobLockedError is not one: it propagates as it is
        raise unwritable(out_dir, e) from None
    try:
        return _run_locked(cfg, typed, out_dir, identity, raise_errors)
    finally:
        lock.release()


def _run_locked(cfg: DictConfig, typed: Optional[Config], out_dir: Path, identity: Optional[dict],
                raise_errors: bool, recorder=None) -> dict:
    identity = identity or job_identity(cfg)
    task = task_name(cfg)
    env = environment()
    summary: dict[str, Any] = {"model": cfg.model.name, "task": task, "status": "running", **env,
                               "choices": identity["choices"], "overrides": identity["overrides"]}
    recorder = recorder or RunRecorder(out_dir, cfg, WandbRun.start(cfg, out_dir, identity, env))
    error: Optional[BaseException] = None
    try:
        recorder.write_config()
        typed = typed or validate(cfg)  # typed once: each group checked itself; the engine and tasks read it
        records = check_workload(typed)  # a bad prompts file or sampling setting fails before the model exists
        t0 = time.perf_counter()
        engine = build_engine(typed, grpo.pool_demand(typed) if task == "grpo" else pool_demand(typed.workload))
        summary["build/seconds"] = time.perf_counter() - t0
        summary.update({f"engine/{k}": v for k, v in engine.info.items()})
        workload = build_workload(typed, engine, records)
        summary["workload/prompts"] = len(workload.prompts)
        summary["workload/prompt_tokens"] = workload.num_prompt_tokens
        for module in TASKS[task]:
            summary.update(module.run(engine, workload, typed, recorder))
        check_requests_ran(summary)
        summary["status"] = "ok"
    except ConfigError as e:
        summary.update(status="invalid", error=bounded(str(e), chars=MAX_ERROR_CHARS))
        error = e
    except Exception as e:  # noqa: BLE001 - the job's record must say why it failed
        summary.update(status="failed", error=bounded(f"{type(e).__name__}: {e}", chars=MAX_ERROR_CHARS),
                       traceback=bounded(traceback.format_exc(), chars=MAX_ERROR_CHARS))
        error = e
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    finally:
        if torch.cuda.is_available():
            summary.setdefault("memory/peak_allocated_gib", torch.cuda.max_memory_allocated() / 2**30)
        path = recorder.write_summary(summary)
        # the table before W&B finishes the run: its closing lines come after, not in front
        wandb_line = f"\n  W&B run: {recorder.wandb_run.where}" if recorder.wandb_run is not None else ""
        if path is not None:  # a rank other than 0 under torchrun writes and prints nothing
            print(f"\nflexgemma {task} on {cfg.model.name}:\n{format_table(summary)}\n  summary: {path}{wandb_line}",
                  flush=True)
        recorder.close(summary["status"])
    if error is not None and raise_errors:
        raise error
    return summary


class AllRequestsFailed(RuntimeError):
    """Every request of the job ended in an error: its throughput and determinism mean nothing."""


def check_requests_ran(summary: dict) -> None:
    errors, total = summary.get("requests/errors"), summary.get("requests/total")
    if total and errors == total:
        raise AllRequestsFailed(f"every one of the {total} requests ended in an error, e.g. "
                                f"{summary.get('requests/first_error')!r}: the measurements of this job mean nothing")


def objective(summary: dict, cfg: DictConfig) -> float:
    """The value the Hydra task function returns (what an Optuna sweep optimises): the metric named by
    task.objective, NaN when the job did not finish ok (Optuna then records the trial as failed)."""
    value = summary.get(str(cfg.task.objective)) if summary.get("status") == "ok" else None
    return float(value) if isinstance(value, (int, float)) else math.nan


def hydra_task(cfg: DictConfig) -> float:
    """The task function Hydra runs for `python -m flexgemma` and for each job of a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from flexgemma.run.console import route_third_party_to_log_file

    route_third_party_to_log_file()  # other libraries' warnings: the job's log file, not the console
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:
        done = read_summary(out_dir)
        if done is not None and done.get("status") == "ok":
            # an interrupted sweep resumes: what finished is not run again
            log.info("skipping %s: it finished before (summary.json has status ok)", out_dir)
            print(f"\nflexgemma (finished before) {done.get('task')} on {done.get('model')}:\n{format_table(done)}")
            return objective(done, cfg)
    try:
        summary = run_job(cfg, out_dir, raise_errors=not multirun)
    except JobLockedError as e:
        if not multirun:
            raise
        log.error("not running this job: %s", e)  # its directory and files are the other process's
        return math.nan
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        raise SystemExit(2) from None
    return objective(summary, cfg)


def job_identity(cfg: DictConfig) -> dict[str, Any]:
    """How the job is named in W&B: group (the sweep, or the experiment), name (the overrides),
    job_type (the task), tags (the Hydra choices)."""
    choices = _choices(cfg)
    identity: dict[str, Any] = {
        "choices": choices, "job_type": task_name(cfg), "overrides": [],
        "tags": [f"{g}={c}" for g, c in choices.items() if c is not None],
        "group": cfg.logger.get("group"), "name": f"{cfg.model.name}-{task_name(cfg)}",
    }
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:  # composed through the API, not the CLI
        return identity
    identity["overrides"] = list(hc.overrides.task)
    identity["name"] = hc.job.override_dirname or "defaults"
    experiment = choices.get("experiment")
    if identity["group"] is None:
        if hc.mode == RunMode.MULTIRUN:
            sweep = "_".join(Path(str(hc.sweep.dir)).parts[-2:])  # e.g. 2026-11-29_07-51-41
            identity["group"] = f"{experiment}/{sweep}" if experiment else sweep
        else:
            identity["group"] = experiment
    return identity


def _choices(cfg: DictConfig) -> dict:
    try:
        from hydra.core.hydra_config import HydraConfig

        choices = {k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}
    except ValueError:  # composed through the API, not the CLI
        names = {g: OmegaConf.select(cfg, f"{g}.name") for g in ("quant", "lora", "attn", "cudagraph", "workload", "task")}
        choices = {g: str(getattr(v, "value", v)) for g, v in names.items()}
    choices["model"] = choices.get("model") or str(cfg.model.name)  # the embedded default has no choice
    return choices
