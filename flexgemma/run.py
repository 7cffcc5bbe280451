"""One job: build the engine, run the task on the workload, record and print the results."""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from flexgemma.builder import build_engine
from flexgemma.tasks import bench, determinism, drift, parity
from flexgemma.tracking import RunRecorder, environment, format_table
from flexgemma.workload import build_workload

log = logging.getLogger("flexgemma")

TASKS = {
    "bench": [bench], "parity": [parity], "determinism": [determinism], "drift": [drift],
    "all": [bench, determinism, parity],
}


def run_job(cfg: DictConfig, out_dir: str | Path) -> dict:
    """Runs cfg.task and writes summary.json; a failure is recorded (status=failed) and re-raised."""
    recorder = RunRecorder(out_dir, cfg)
    task = str(getattr(cfg.task.name, "value", cfg.task.name))
    summary: dict = {"model": cfg.model.name, "task": task, "status": "running"}
    summary.update(environment())
    summary["choices"] = _choices(cfg)
    try:
        t0 = time.perf_counter()
        engine = build_engine(cfg)
        summary["build/seconds"] = time.perf_counter() - t0
        summary.update({f"engine/{k}": v for k, v in engine.info.items()})
        workload = build_workload(cfg, engine)
        summary["workload/prompts"] = len(workload.prompts)
        summary["workload/prompt_tokens"] = workload.num_prompt_tokens
        for module in TASKS[task]:
            summary.update(module.run(engine, workload, cfg, recorder))
        summary["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the job's record must say why it failed
        summary["status"] = "failed"
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc()
        raise
    finally:
        if torch.cuda.is_available():
            summary.setdefault("memory/peak_allocated_gib", torch.cuda.max_memory_allocated() / 2**30)
        path = recorder.write_summary(summary)
        recorder.close()
        print(f"\nflexgemma {task} on {cfg.model.name}:\n{format_table(summary)}\n  summary: {path}")
    return summary


def _choices(cfg: DictConfig) -> dict:
    try:
        from hydra.core.hydra_config import HydraConfig

        return {k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}
    except ValueError:  # composed through the API, not the CLI
        return {g: str(OmegaConf.select(cfg, f"{g}.name")) for g in ("model", "quant", "lora", "attn", "workload")}
