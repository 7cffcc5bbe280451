"""task=grpo across ranks: one process per GPU (torchrun / accelerate launch), one engine per process.

What is distributed is TRL's and accelerate's: the process group (accelerate's PartialState, built
when the GRPOConfig is made: NCCL on GPUs, gloo on the CPU), the prompt shards (TRL's RepeatSampler
repeats each prompt num_generations times in a row and accelerate hands each process its own
consecutive block of the step's rows; a block of whole groups keeps every group on one rank), and
the gradients (DDP all-reduce). This module adds only what the engine needs around that:

- the rank's device (cuda:LOCAL_RANK) before the engine is built;
- a digest of the adapter per rank after each optimizer step, gathered and checked equal (every
  rank's engine generates the next step with those factors);
- the per-step metrics reduced across ranks for rank 0's records (tokens summed, times max).

Only rank 0 writes the run's records; the other ranks' recorder writes nothing (NullRecorder).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from flexgemma.config.schema import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world() -> World:
    """This process's place, from the variables torchrun and accelerate launch set (one process: 0/0/1);
    in a SLURM job of several tasks started by submitit (hydra/launcher=flexgemma_slurm with
    tasks_per_node=GPUs), submitit's own TorchDistributedEnvironment sets them first."""
    env = os.environ
    if "WORLD_SIZE" not in env and "SUBMITIT_EXECUTOR" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        # every task sees the node's GPUs and takes cuda:LOCAL_RANK (use_rank_device)
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    try:
        size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE/RANK/LOCAL_RANK must be integers (as torchrun sets them): {e}") from None
    return World(rank, local, size)


def check_task(task: str, w: World) -> None:
    if w.size > 1 and task != "grpo":
        raise ConfigError(f"task={task} under torchrun/accelerate with WORLD_SIZE={w.size}: only task=grpo runs "
                          "across ranks; run other tasks as one process (a sweep places one job per GPU)")


def use_rank_device(w: World) -> None:
    """Make cuda:LOCAL_RANK this process's current device, so device=cuda/auto builds the engine there."""
    if w.size > 1 and torch.cuda.is_available():
        if w.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={w.local_rank} but {torch.cuda.device_count()} GPUs are visible: "
                              "launch at most one process per GPU (--nproc_per_node)")
        torch.cuda.set_device(w.local_rank)


def adapter_digest(tensors) -> str:
    """sha256 of the adapter's factors (names and bytes, in name order): equal digests, equal adapters."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class AdapterMismatch(RuntimeError):
    """The ranks' adapters differ after an optimizer step: they would generate with different weights."""


def check_equal(step: int, digests: list[str]) -> None:
    """Raises AdapterMismatch naming the ranks whose adapter differs from rank 0's."""
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise AdapterMismatch(f"after optimizer step {step} the adapter of rank(s) {bad} differs from rank 0's "
                              f"(sha256 {', '.join(f'rank {r}: {d[:12]}' for r, d in enumerate(digests))}): "
                              "the ranks no longer train one model (were gradients all-reduced? same lora.seed?)")


def gather(obj) -> list:
    """Every rank's obj, in rank order ([obj] in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_step(parts: list[dict]) -> dict:
    """One step's metrics from every rank's: rewards pooled, tokens summed, times max, mismatch
    means averaged and maxima maxed (keys of flexgemma/tasks/grpo.py's rows)."""
    nan = float("nan")

    def vals(k):
        return [p[k] for p in parts if k in p and p[k] == p[k]]

    def agg(k, f):
        v = vals(k)
        return f(v) if v else nan

    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {
        "rewards": [x for p in parts for x in p.get("rewards", [])],
        "rollout_s": agg("rollout_s", max), "step_s": agg("step_s", max), "refresh_ms": agg("refresh_ms", max),
        "generate_s": agg("generate_s", max),
        "rollout_tokens": sum(p.get("rollout_tokens", 0.0) for p in parts),
        "logprob_absdiff_mean": agg("logprob_absdiff_mean", mean), "logprob_absdiff_max": agg("logprob_absdiff_max", max),
        "kl_k3": agg("kl_k3", mean), "is_ratio_p99": agg("is_ratio_p99", max), "is_ratio_max": agg("is_ratio_max", max),
        "router_flip_rate": agg("router_flip_rate", mean),
    }


def scratch_dir() -> Path:
    """Where a rank other than 0 lets the trainer put its output_dir (it writes nothing there)."""
    return Path(tempfile.mkdtemp(prefix=f"flexgemma-rank{world().rank}-"))


class NullRecorder:
    """RunRecorder's interface for ranks other than 0: the records are rank 0's alone."""

    def __init__(self, cfg=None):
        self.cfg = cfg
        self.dir = scratch_dir()
        self.wandb_run = None

    def write_config(self) -> None:
        pass

    def log_round(self, row) -> None:
        pass

    def write_completions(self, rows):
        return None

    def write_summary(self, summary):
        return None

    def close(self, status: str = "ok") -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
