"""Run records: summary.json, metrics.jsonl, the resolved config, the environment, the end table.

Metric names are flat "group/name" keys, the same in summary.json, metrics.jsonl and W&B.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf


def environment() -> dict[str, Any]:
    import transformers

    env = {
        "env/python": platform.python_version(),
        "env/torch": torch.__version__,
        "env/transformers": transformers.__version__,
        "env/cuda": torch.version.cuda or "none",
        "env/gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "env/git_sha": _git_sha(),
        "env/threads": torch.get_num_threads(),
        "env/cpu": _cpu_model(),
        "env/omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "env/peft": _version("peft"),
        "env/bitsandbytes": _version("bitsandbytes"),  # read from the metadata: importing it starts its OpenMP pool
    }
    try:
        import triton

        env["env/triton"] = triton.__version__
    except ImportError:
        env["env/triton"] = "none"
    if torch.cuda.is_available():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            env["env/driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
        except (OSError, subprocess.SubprocessError, IndexError):
            env["env/driver"] = "unknown"
    return env


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _git_sha() -> str:
    """The commit, with "-dirty" when the checkout has changes it does not hold (then the commit alone
    does not say what ran)."""
    try:
        cmd = ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"]  # the commit, never a tag
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


class RunDirError(OSError):
    """The job's directory cannot be created or written; the message names it and says what to do."""


def unwritable(path: Path, e: OSError) -> RunDirError:
    return RunDirError(f"cannot write the job's files in {path} ({type(e).__name__}: {e.strerror or e}): a read-only "
                       "directory or a full disk? give a writable one with hydra.run.dir=... (hydra.sweep.dir=... "
                       "for a sweep)")


class RunRecorder:
    """Writes a job's files into its own directory (the Hydra run dir), and mirrors rows and the
    summary to a W&B run (flexgemma.run.wandb_logger.WandbRun) when one is given."""

    def __init__(self, out_dir: str | Path, cfg: DictConfig, wandb_run=None):
        self.dir = Path(out_dir)
        self.cfg = cfg
        self.wandb_run = wandb_run
        self.completions_path = self.dir / "completions.jsonl"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # "w": a re-run of a failed sweep job starts its rows afresh
            self._metrics = open(self.dir / "metrics.jsonl", "w")
        except OSError as e:
            if wandb_run is not None:
                wandb_run.finish("failed")
            raise unwritable(self.dir, e) from None

    def write_config(self) -> None:
        """config_resolved.yaml; raises when an interpolation cannot resolve (the job then fails)."""
        (self.dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))

    def log_round(self, row: dict[str, Any]) -> None:
        row = _jsonable(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self.wandb_run is not None:
            self.wandb_run.log_round(row)

    def write_completions(self, rows: list[dict[str, Any]]) -> Path:
        with open(self.completions_path, "w") as f:
            for row in rows:
                f.write(json.dumps(_jsonable(row), ensure_ascii=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log_completions(rows)
        return self.completions_path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = write_summary(self.dir, summary)
        if self.wandb_run is not None:
            self.wandb_run.set_summary(_jsonable(summary))
        return path

    def close(self, status: str = "ok") -> None:
        self._metrics.close()
        if self.wandb_run is not None:
            files = [self.dir / n for n in ("summary.json", "metrics.jsonl", "config_resolved.yaml", "completions.jsonl")]
            self.wandb_run.finish(status, files)
            self.wandb_run = None


def write_summary(job_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Writes a job's summary.json whole (via a temporary file); RunDirError when it cannot be written.
    The one writer of summary.json: the job itself, and the sweep launcher for jobs that died."""
    path = Path(job_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a job that died before creating its directory
        tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True))
        tmp.replace(path)  # a summary exists only once complete: sweeps resume on its presence
    except OSError as e:
        raise unwritable(Path(job_dir), e) from None
    return path


def read_summary(job_dir: str | Path) -> dict[str, Any] | None:
    """A job's summary.json, or None when there is none (or it is unreadable)."""
    path = Path(job_dir) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def format_table(summary: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    rows = [
        ("model", summary.get("model")),
        ("device", summary.get("env/gpu") if summary.get("env/gpu") not in (None, "none") else "cpu"),
        ("status", summary.get("status")),
        ("output tok/s (median)", summary.get("throughput/output_tok_s_median")),
        ("total tok/s, prompt + output", summary.get("throughput/total_tok_s_median")),
        ("requests/s", summary.get("throughput/requests_s_median")),
        ("decode tok/s (median)", summary.get("throughput/decode_tok_s_median")),
        ("prefill tok/s (median)", summary.get("throughput/prefill_tok_s_median")),
        ("TTFT p50 / p99 ms", _pair(summary, "latency/ttft_p50_ms", "latency/ttft_p99_ms")),
        ("TPOT p50 / p99 ms", _pair(summary, "latency/tpot_p50_ms", "latency/tpot_p99_ms")),
        ("ITL p50 / p99 ms", _pair(summary, "latency/itl_p50_ms", "latency/itl_p99_ms")),
        ("peak memory GiB", summary.get("memory/peak_allocated_gib")),
        ("KV pool GiB", summary.get("memory/kv_pool_gib")),
        ("decode bandwidth GB/s", summary.get("bandwidth/decode_gb_s_median")),
        ("graph padding waste", summary.get("cudagraph/padding_waste")),
        ("weights GiB", summary.get("memory/weights_gib")),
        ("4-bit fraction of params", summary.get("quant/fraction_4bit") if summary.get("engine/quant/method") else None),
        ("build s", summary.get("build/seconds")),
        ("deterministic (run-to-run)", summary.get("determinism/run_to_run")),
        ("parity token match %", summary.get("parity/token_match_pct")),
        ("GRPO reward, first / last 5 steps", _pair(summary, "grpo/reward_first5", "grpo/reward_last5")),
        ("GRPO steps, step s (median)", _steps(summary)),
        ("GRPO rollout / train s (medians)", _pair(summary, "grpo/rollout_s_median", "grpo/train_s_median")),
        ("GRPO step s, steps that compiled nothing", _finite(summary.get("grpo/step_s_median_warm"))),
        ("GRPO engine vs trainer: |dlogp| mean / max, IS max", _mismatch(summary)),
        ("LoRA refresh ms", summary.get("lora/refresh_ms", summary.get("engine/lora_refresh_ms"))),
        ("drift: base / merge / tokens identical", _triple(summary)),
        ("error", summary.get("error")),
    ]
    rows = [(k, v) for k, v in rows if v is not None]
    width = max(len(k) for k, _ in rows)
    fmt = lambda v: f"{v:,.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(f"  {k:<{width}}  {fmt(v)}" for k, v in rows)


def _pair(s: dict, a: str, b: str):
    if s.get(a) is None:
        return None
    return f"{s[a]:.2f} / {s[b]:.2f}"


def _steps(s: dict):
    if s.get("grpo/steps") is None:
        return None
    return f"{s['grpo/steps']}, {s.get('grpo/step_s_median', float('nan')):.2f}"


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _mismatch(s: dict):
    """The rollout-vs-trainer gap (task=grpo with the engine generating); exactly 0 / 0, 1 when on-policy."""
    keys = ("grpo/logprob_absdiff_mean", "grpo/logprob_absdiff_max", "grpo/is_ratio_max")
    if any(_finite(s.get(k)) is None for k in keys):
        return None
    return "{:.3g} / {:.3g}, {:.3g}".format(*(s[k] for k in keys))


def _triple(s: dict):
    keys = ("drift/base_bit_identical", "drift/merge_bit_identical", "drift/inference_deterministic")
    if s.get(keys[0]) is None:
        return None
    return " / ".join(str(s[k]) for k in keys)
