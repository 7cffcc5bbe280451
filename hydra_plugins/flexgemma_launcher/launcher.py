"""Hydra launchers that run every sweep job in its own process, through submitit.

Why not hydra-submitit-launcher as it is: it runs all local jobs at once on the same GPUs (which
spoils every measurement), and one job whose process dies (a segfault, the OOM killer) makes the
whole sweep raise. These launchers reuse its job function (the same pickled Hydra job as
`submitit_local` / `submitit_slurm`, so every option of those configs works) and add:

- one job per GPU at a time on the local machine (`parallel_jobs`: null = one per visible GPU,
  each job seeing only its own GPU; 1 on a machine without a GPU);
- resume: a job whose directory already holds a summary.json with status ok is not started again
  (re-run an interrupted sweep with the same `hydra.sweep.dir=...`);
- a job whose process ends without a result gets a summary.json with status failed and the tail of
  its stderr, and the sweep goes on (the job is handed to the sweeper as completed with a NaN
  value: a failed Optuna trial, nothing for the basic sweeper);
- a progress bar over the jobs, a line as each ends, and a table of all of them at the end.

Without submitit (the [slurm] extra), `flexgemma_local` runs the sweep through Hydra's basic launcher
instead: every job in this process, one after another (on a CPU the faster way: no process start
and import a job), still resumable, and it logs that it did.

This module is imported by Hydra's plugin scan in every Hydra program of the environment, so it
imports nothing heavy at module level.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError:  # without the [slurm] extra: the plugin scan stays quiet, a local sweep runs in process
    from hydra.plugins.launcher import Launcher

    BaseQueueConf = None

    class BaseSubmititLauncher(Launcher):  # type: ignore[no-redef]
        def __init__(self, **params: Any) -> None:
            self.params = params
            self.config = self.hydra_context = self.task_function = None

        def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
            self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

log = logging.getLogger(__name__)

_POLL_S = 0.2


def read_summary(job_dir: Path) -> Optional[dict]:
    from flexgemma.run.tracking import read_summary  # imported here: the plugin scan must stay light

    return read_summary(job_dir)


def write_summary(job_dir: Path, summary: dict) -> None:
    """Records a job's summary; a directory that cannot be written is logged, never raised: one job's
    I/O failure must not stop the sweep (the end table still shows the job and its error)."""
    from flexgemma.run.tracking import write_summary

    try:
        write_summary(job_dir, summary)
    except OSError as e:
        log.error("could not record job %s in %s (%s: %s); the sweep goes on", summary.get("status"), job_dir,
                  type(e).__name__, e)
        summary["record_error"] = f"summary.json not written: {type(e).__name__}: {e}"


def check_options(parallel_jobs: Any, params: dict) -> None:
    """Launcher options that would hang or misbehave are errors before any job starts."""
    timeout = params.get("timeout_min")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"hydra.launcher.timeout_min={timeout!r}: must be a positive number of minutes per job")
    if parallel_jobs is not None and (isinstance(parallel_jobs, bool) or not isinstance(parallel_jobs, int)
                                      or parallel_jobs < 1):
        raise ValueError(f"hydra.launcher.parallel_jobs={parallel_jobs!r}: must be an integer >= 1 (jobs at once), "
                         "or null for one job per visible GPU")


def _lock_holder(job_dir: Path) -> Optional[dict]:
    from flexgemma.run.joblock import holder  # imported here: the plugin scan must stay light

    return holder(job_dir)


class _ResumableSubmititLauncher(BaseSubmititLauncher):
    def __init__(self, parallel_jobs: Optional[int] = None, **params: Any) -> None:
        super().__init__(**params)
        self.parallel_jobs = parallel_jobs

    # -- the sweep ------------------------------------------------------------------------------
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from tqdm.auto import tqdm

        assert self.config is not None and self.hydra_context is not None
        if self._EXECUTOR == "local" and not submitit_installed():
            return self._launch_in_process(job_overrides, initial_job_idx)
        check_options(self.parallel_jobs, self.params)
        # every job's process inherits it: OpenMP threads that spin while waiting fight torch's (and
        # bitsandbytes') pools on a CPU; a user's own setting is kept
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's usage telemetry (flexgemma/__main__.py)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        state = Singleton.get_state()  # before job_dir() touches HydraConfig
        jobs = [_Job(initial_job_idx + i, list(o), self.job_dir(list(o), initial_job_idx + i))
                for i, o in enumerate(job_overrides)]
        log.info("flexgemma sweep of %d jobs in %s: launcher flexgemma_%s, each job in its own process (submitit)",
                 len(jobs), sweep_dir, self._EXECUTOR)
        bar = tqdm(total=len(jobs), desc="sweep", unit="job", dynamic_ncols=True)
        counts: dict[str, int] = {}

        def done(job: "_Job") -> None:
            counts[job.status] = counts.get(job.status, 0) + 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)
            bar.write(f"[sweep {bar.n}/{bar.total}] #{job.idx} {job.status:<8} {self._value_text(job)}"
                      f"{' '.join(filter_overrides(job.overrides))}  -> {job.dir}")

        todo = []
        for job in jobs:
            summary = read_summary(job.dir)
            owner = _lock_holder(job.dir) if summary is None or summary.get("status") != "ok" else None
            if summary is not None and summary.get("status") == "ok":
                job.finish_skipped(summary, self._objective(summary))
                done(job)
            elif owner is not None:  # an earlier launch's job still runs there: never a second copy
                job.finish_running(owner)
                done(job)
            else:
                todo.append(job)
        try:
            self._run(todo, state, done)
        finally:
            bar.close()
        print(self._table(jobs), flush=True)
        return [job.result for job in jobs]

    def _run(self, jobs: list["_Job"], state: dict, done) -> None:
        raise NotImplementedError  # each executor submits in its own way

    def _launch_in_process(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Without submitit: Hydra's basic launcher, every job in this process, one after another. A
        job that finished before is still skipped (the task function reads its summary.json), and a
        failed job is recorded and the sweep goes on (the task function catches it)."""
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        from flexgemma.config.extras import install_hint

        log.info("flexgemma sweep of %d jobs in %s: launcher basic (Hydra's), every job in this process one after "
                 "another, because submitit is not installed (%s: a process a job, one per GPU)",
                 len(job_overrides), self.config.hydra.sweep.dir, install_hint("slurm"))
        basic = BasicLauncher()
        basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
        results = basic.launch(job_overrides, initial_job_idx)
        jobs = []
        for i, (overrides, ret) in enumerate(zip(job_overrides, results)):
            job = _Job(initial_job_idx + i, list(overrides), Path(str(ret.working_dir)))
            summary = read_summary(job.dir) or {}
            job.finish(ret, summary.get("status", "failed"), summary)
            jobs.append(job)
        print(self._table(jobs), flush=True)
        return results

    def job_dir(self, overrides: list[str], idx: int) -> Path:
        """The directory Hydra gives job `idx` (hydra.sweep.dir / hydra.sweep.subdir)."""
        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job):
            sweep_config.hydra.job.num = idx
        saved = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(sweep_config)  # ${hydra:job.num} etc. resolve against this job
        try:
            return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
        finally:
            HydraConfig.instance().cfg = saved

    def _executor(self, folder_suffix: str = ""):
        import submitit

        params = dict(self.params)
        folder = params.pop("submitit_folder")
        init = {"folder": folder + folder_suffix}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor

    def _job_args(self, job: "_Job", state: dict) -> tuple:
        # the arguments of BaseSubmititLauncher.__call__, which runs the Hydra job in the new process
        return (job.overrides, "hydra.sweep.dir", job.idx, f"job_id_for_{job.idx}", state)

    # -- results --------------------------------------------------------------------------------
    def _collect(self, job: "_Job", handle) -> None:
        try:
            ret = handle.results()[0]
        except Exception as e:  # noqa: BLE001 - the job's process died: record it, the sweep goes on
            job.finish_crashed(e, _stderr_tail(handle))
            if job.status == "ok":
                job.result.return_value = self._objective(job.summary)
            return
        summary = read_summary(job.dir) or {}
        owner = _lock_holder(job.dir)
        if owner is not None:  # this job found its directory locked by a live process and ran nothing
            job.finish_running(owner)
            return
        if ret.status == JobStatus.FAILED:  # the task raised outside of what it records itself
            err = ret._return_value
            if summary.get("status") not in ("failed", "invalid"):
                summary = {**summary, "status": "failed", "error": f"{type(err).__name__}: {err}",
                           "overrides": job.overrides}
                write_summary(job.dir, summary)
            ret.status, ret.return_value = JobStatus.COMPLETED, math.nan
        job.finish(ret, summary.get("status", "ok"), summary)

    def _objective(self, summary: dict) -> float:
        key = OmegaConf.select(self.config, "task.objective")
        value = summary.get(key) if key and summary.get("status") == "ok" else None
        return float(value) if isinstance(value, (int, float)) else math.nan

    def _value_text(self, job: "_Job") -> str:
        key = OmegaConf.select(self.config, "task.objective")
        value = self._objective(job.summary) if job.summary else math.nan
        return f"{key}={value:,.2f}  " if key and not math.isnan(value) else ""

    def _table(self, jobs: list["_Job"]) -> str:
        key = OmegaConf.select(self.config, "task.objective") or "value"
        rows = [("#", "status", key, "overrides / error")]
        for j in jobs:
            v = self._objective(j.summary) if j.summary else math.nan
            text = " ".join(filter_overrides(j.overrides)) or "(defaults)"
            if j.status not in ("ok", "skipped") and j.summary.get("error"):
                text += f"  | {str(j.summary['error']).splitlines()[0][:120]}"
            if j.summary.get("record_error"):
                text += f"  | {j.summary['record_error'][:120]}"
            rows.append((str(j.idx), j.status, "" if math.isnan(v) else f"{v:,.2f}", text))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\nsweep results:\n  " + "\n  ".join(lines)


class _Job:
    def __init__(self, idx: int, overrides: list[str], job_dir: Path):
        self.idx, self.overrides, self.dir = idx, overrides, job_dir
        self.status = "pending"
        self.summary: dict = {}
        self.result: Optional[JobReturn] = None

    def _return(self, value: Any) -> JobReturn:
        return JobReturn(overrides=self.overrides, working_dir=str(self.dir), status=JobStatus.COMPLETED,
                         _return_value=value)

    def finish_skipped(self, summary: dict, value: float) -> None:
        self.status, self.summary, self.result = "skipped", summary, self._return(value)

    def finish_running(self, owner: dict) -> None:
        message = (f"not run: its directory is locked by process {owner.get('pid')} on {owner.get('host')}, "
                   "a job of an earlier launch still running; re-run the sweep when it ends")
        self.status, self.summary = "running", {"status": "running", "error": message}
        self.result = self._return(math.nan)

    def finish_crashed(self, error: Exception, stderr_tail: str, started: bool = True) -> None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        what = "the job's process ended without a result" if started else "the job could not be started"
        message = f"{what} ({type(error).__name__}: {first})"
        summary = read_summary(self.dir) or {}
        if summary.get("status") == "ok":
            # the job finished and recorded itself, then its process died on the way out (e.g. in
            # CUDA teardown): the measurements stand, the exit is noted
            self.summary = {**summary, "exit_error": message, "stderr_tail": stderr_tail}
            write_summary(self.dir, self.summary)
            self.status, self.result = "ok", self._return(None)
            return
        self.summary = {**summary, "status": "failed", "overrides": self.overrides, "error": message,
                        "stderr_tail": stderr_tail}
        write_summary(self.dir, self.summary)
        self.status, self.result = "failed", self._return(math.nan)

    def finish(self, ret: JobReturn, status: str, summary: dict) -> None:
        self.status, self.summary, self.result = status, summary, ret


def submitit_installed() -> bool:
    """Whether the [slurm] extra's packages can be imported (without importing them)."""
    import importlib.util

    return BaseQueueConf is not None and importlib.util.find_spec("submitit") is not None


def _stderr_tail(handle, chars: int = 4000) -> str:
    try:
        return (handle.stderr() or "")[-chars:]
    except Exception:  # noqa: BLE001 - no log is no reason to lose the record
        return ""


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [x.strip() for x in listed.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


class FlexgemmaLocalLauncher(_ResumableSubmititLauncher):
    """`hydra/launcher=flexgemma_local`: jobs in processes of this machine, one per GPU at a time."""

    _EXECUTOR = "local"

    def _run(self, jobs: list[_Job], state: dict, done) -> None:
        gpus = _visible_gpus()
        n = self.parallel_jobs or max(1, len(gpus))
        slots: list[Optional[tuple[_Job, Any]]] = [None] * n
        pending = list(jobs)
        try:
            while pending or any(slots):
                for s in range(n):
                    while slots[s] is None and pending:
                        job = pending.pop(0)
                        try:
                            slots[s] = (job, self._submit(job, state, gpus[s % len(gpus)] if gpus else None))
                        except Exception as e:  # noqa: BLE001 - this job cannot start; the others still can
                            job.finish_crashed(e, "", started=False)
                            done(job)
                    entry = slots[s]
                    if entry is not None and entry[1].done():
                        self._collect(*entry)
                        done(entry[0])
                        slots[s] = None
                time.sleep(_POLL_S)
        except BaseException:
            for entry in slots:  # Ctrl-C or an error here: stop the jobs this sweep started
                if entry is not None:
                    entry[1].cancel(check=False)
            raise

    def _submit(self, job: _Job, state: dict, gpu: Optional[str]):
        executor = self._executor()
        # submitit sets CUDA_VISIBLE_DEVICES from integer ids only; a shell `setup` line also takes
        # UUIDs and MIG names, so every job sees exactly its one GPU (or none on a CPU machine)
        executor.update_parameters(gpus_per_node=0, local_setup=[f"export CUDA_VISIBLE_DEVICES={shlex.quote(gpu or '')}"])
        handle = executor.submit(self, *self._job_args(job, state))
        # submitit waits 15 s for the result file of a dead job (grace for network file systems);
        # the files of a local job are on this machine
        handle._results_timeout_s = 2
        return handle


class FlexgemmaSlurmLauncher(_ResumableSubmititLauncher):
    """`hydra/launcher=flexgemma_slurm`: the unfinished jobs as one SLURM job array (array_parallelism
    at once), each on its own node slot and GPU as the config asks (gpus_per_node, partition, ...)."""

    _EXECUTOR = "slurm"

    def _run(self, jobs: list[_Job], state: dict, done) -> None:
        if not jobs:
            return
        executor = self._executor()
        handles = executor.map_array(self, *zip(*(self._job_args(j, state) for j in jobs)))
        waiting = dict(zip(range(len(jobs)), handles))
        while waiting:
            for i, handle in list(waiting.items()):
                if handle.done():
                    self._collect(jobs[i], handle)
                    done(jobs[i])
                    del waiting[i]
            time.sleep(max(_POLL_S, 5.0))  # the queue is polled through squeue/sacct
