"""GRPO on the H200: E2B bf16 + LoRA r32 (generator flexgemma vs trl, side by side) and 26B-A4B
quant=bnb4 + LoRA r16, each a job of the presets `experiment=grpo_e2b` / `grpo_26b_a4b` with the
overrides that make the A/B (trainer forward, micro-batch, backward references); prints the step-time table.

    python experiments/grpo_gpu.py [--steps 12] [--out results/grpo] [--only e2b_flexgemma,...]
    python experiments/grpo_gpu.py --collect DIR [DIR ...]   # the table of finished job dirs, no run
    python experiments/grpo_gpu.py --smoke --steps 2 --out /tmp/smoke  # the same jobs, tiny models, CPU

(One job takes ~2-5 minutes with its build; under a 10-minute limit a call, run them one by one with
--only and --out $OUT, then --collect the job dirs.)

Needs the rl extra (trl, datasets) beside torch/transformers/peft/hydra/bitsandbytes; logger=none.
Random weights: the reward is TargetTokens on 1/8 of the vocabulary, so the numbers are about speed,
memory and engine-vs-trainer agreement, not about what is learned.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["logger=none"]
# the trainer's logprobs through the engine's kernels, the rollout batch-invariant: exact IS ratios
# (experiment=grpo_e2b's own setting; the smoke jobs and grpo_26b_a4b need it said)
EXACT = ["engine.batch_invariant=true", "task.trainer_forward=engine"]
# the usual GRPO: the engine rolls out in its default mode, the trainer runs transformers' forward
INEXACT = ["engine.batch_invariant=false", "task.trainer_forward=transformers"]
# the trainer's backward through its references (the glue op by op, attention and experts in float32;
# the kernels.trainer_* defaults before call27): the A/B of those keys' defaults
REFERENCE = ["kernels.trainer_glue_backward=eager", "kernels.trainer_backward_dtype=float32"]
KEEP = ["task.gradient_checkpointing=false"]
GEN = "task.generator=flexgemma"
ONE_MICRO = "task.micro_batch=null"  # the whole step as one micro-batch (task=grpo's default)
# the KV cache given back while the trainer computes, in CUDA virtual memory so each wake keeps the graphs
SLEEP = ["task.engine_sleep=true", "engine.sleep_mode=true"]


def e2b_jobs(base: list[str], half_micro: str) -> dict[str, list[str]]:
    """The E2B jobs over `base` (the model and its step; `half_micro`: half its micro-batch)."""
    return {
        "e2b_flexgemma": [*base, GEN, *INEXACT],
        "e2b_exact": [*base, GEN, *EXACT],
        "e2b_exact_reference": [*base, GEN, *EXACT, *REFERENCE],
        "e2b_exact_separate": [*base, GEN, *EXACT, "task.ratio_forward=separate"],
        "e2b_exact_keep": [*base, GEN, *EXACT, *KEEP],
        "e2b_exact_keep8": [*base, GEN, *EXACT, *KEEP, half_micro],
        # the whole step as one micro-batch: the trainer's fixed cost a micro-batch paid once
        "e2b_exact_mb64": [*base, GEN, *EXACT, ONE_MICRO],
        "e2b_exact_reference_mb64": [*base, GEN, *EXACT, *REFERENCE, ONE_MICRO],
        "e2b_exact_mb64_torch_recompute": [*base, GEN, *EXACT, ONE_MICRO, "kernels.trainer_recompute=reference"],
        "e2b_exact_mb64_pointers": [*base, GEN, *EXACT, ONE_MICRO, "kernels.invariant_loads=pointers"],
        "e2b_trl": [*base, "task.generator=trl", *INEXACT],
    }


def moe_jobs(base: list[str], exact_extra: list[str], double_micro: str) -> dict[str, list[str]]:
    """The 26B-A4B bnb4 jobs over `base` (`exact_extra`: what the exact ones add; `double_micro`: twice its
    micro-batch)."""
    return {"26b_bnb4_exact": [*base, *exact_extra, *EXACT],
            "26b_bnb4_exact_reference": [*base, *exact_extra, *EXACT, *REFERENCE],
            "26b_bnb4_exact_mb32": [*base, *exact_extra, *EXACT, ONE_MICRO],
            "26b_bnb4_exact_sleep": [*base, *exact_extra, *EXACT, *SLEEP],
            "26b_bnb4_exact_mb32_sleep": [*base, *exact_extra, *EXACT, ONE_MICRO, *SLEEP],
            # between the two: two micro-batches of 16, the KV given back
            "26b_bnb4_exact_mb16_sleep": [*base, *exact_extra, *EXACT, double_micro, *SLEEP],
            "26b_bnb4_flexgemma": [*base, *INEXACT, "task.gradient_checkpointing=true"]}


# the presets (conf/experiment/grpo_e2b.yaml, grpo_26b_a4b.yaml) with the settings their jobs were first
# measured at: E2B in micro-batches of 16 (the preset trains the step as one), 26B-A4B in micro-batches of 8
# with the KV kept (the preset: 16, the KV given back, = 26b_bnb4_exact_mb16_sleep)
E2B = ["experiment=grpo_e2b", "task.micro_batch=16"]
B26 = ["experiment=grpo_26b_a4b", GEN, "task.micro_batch=8", "task.engine_sleep=false", "engine.sleep_mode=false"]
JOBS = {**e2b_jobs(E2B, "task.micro_batch=8"), **moe_jobs(B26, [], "task.micro_batch=16")}
# --smoke: the same jobs on the CPU test models (a script that crashes on the H200 wastes device time); the
# presets are written for the real models, so these spell the task out
SMOKE = ["task=grpo", "device=cpu", "model.dtype=float32", "workload.num_prompts=8", "workload.min_prompt_len=8",
         "workload.max_prompt_len=16", "task.prompts_per_step=2", "task.num_generations=4", "task.max_new_tokens=4",
         "task.micro_batch=4", "task.reward.high=67", "task.learning_rate=1e-5"]
SMOKE_JOBS = {**e2b_jobs(["+model=tiny", "lora=r32", *SMOKE], "task.micro_batch=2"),
              **moe_jobs(["+model=tiny_moe", "quant=bnb4", "lora=r16", GEN, *SMOKE], ["model.dtype=bfloat16"],
                         "task.micro_batch=8")}
COLUMNS = [("job", None), ("steps", "grpo/steps"), ("step s", "grpo/step_s_median"),
           ("rollout s", "grpo/rollout_s_median"), ("generate s", "grpo/generate_s_median"),
           ("train s", "grpo/train_s_median"),
           ("warm step s", "grpo/step_s_median_warm"), ("warm train s", "grpo/train_s_median_warm"),
           ("compiling steps", "grpo/compiling_steps"),
           ("refresh ms", "grpo/refresh_ms_median"), ("rollout share", "grpo/rollout_share"),
           ("rollout tok/s", "grpo/rollout_tok_s_median"), ("|dlogp| mean", "grpo/logprob_absdiff_mean"),
           ("|dlogp| max", "grpo/logprob_absdiff_max"), ("kl_k3", "grpo/kl_k3"), ("IS max", "grpo/is_ratio_max"),
           ("reward 1st5", "grpo/reward_first5"), ("reward last5", "grpo/reward_last5"),
           ("peak GiB", "memory/peak_allocated_gib"), ("rollout peak", "memory/rollout_peak_gib"),
           ("train peak", "memory/train_peak_gib"), ("wake ms", "grpo/wake_ms_median"),
           ("base GiB", "grpo/shared_base_bytes"),
           ("KV GiB", "engine/kv_pool_bytes"),
           ("optim GiB", "grpo/optimizer_state_bytes"), ("merged GiB", "grpo/merged_copy_bytes"), ("status", "status")]


def run(name: str, overrides: list[str], out: Path, steps: int) -> dict:
    job_dir = out / name
    cmd = [sys.executable, "-m", "flexgemma", *COMMON, *overrides, f"task.steps={steps}", f"hydra.run.dir={job_dir}"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    summary_path = job_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"status": f"rc {proc.returncode}"}
    summary["wall_s"] = time.perf_counter() - t0
    return summary


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def table(results: dict[str, dict]) -> str:
    rows = [[h for h, _ in COLUMNS]]
    for name, s in results.items():
        rows.append([name] + [fmt(s[k] / 2**30 if k.endswith("_bytes") and k in s else s.get(k, "-"))
                              for _, k in COLUMNS[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.environ.get("OUT", "results/grpo"))
    ap.add_argument("--only", default=",".join(JOBS))
    ap.add_argument("--smoke", action="store_true", help="the same jobs on tiny / tiny_moe on the CPU")
    ap.add_argument("--collect", nargs="*", help="job dirs (with summary.json) to tabulate instead of running")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.collect:
        results = {Path(d).name: json.loads((Path(d) / "summary.json").read_text()) for d in args.collect}
    else:
        jobs = SMOKE_JOBS if args.smoke else JOBS
        results = {name: run(name, jobs[name], out, args.steps) for name in args.only.split(",")}
    text = table(results)
    e2b = results.get("e2b_flexgemma"), results.get("e2b_trl")
    if all(e2b) and all("grpo/step_s_median" in s for s in e2b):
        text += f"\n\nE2B GRPO step, trl / flexgemma: {e2b[1]['grpo/step_s_median'] / e2b[0]['grpo/step_s_median']:.2f}x"
    print("\n" + text, flush=True)
    (out / "grpo_table.txt").write_text(text + "\n")
    (out / "grpo_summaries.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
