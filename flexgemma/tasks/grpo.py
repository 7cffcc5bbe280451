"""task=grpo: TRL's GRPOTrainer trains the engine's LoRA adapter, generating through the engine.

Each step: the engine takes the trainer's adapter (update_lora, in place), generates
`num_generations` completions for each of `prompts_per_step` prompts, the reward scores them, the
trainer computes its own logprobs of the sampled tokens (the importance-sampling correction and the
mismatch metrics), and takes one optimizer step. `task.generator=trl` lets TRL generate with
transformers instead (the same model, config and reward), for the side-by-side.

Under torchrun / accelerate launch each rank runs this with its own engine and its share of the
step's prompts (flexgemma/rl/ranks.py); rank 0 writes the records, its rows reducing every rank's.

Rows of metrics.jsonl: one per step (grpo/*); summary: grpo/* aggregates (flexgemma/run/metrics.py).
The trained adapter is saved to <job dir>/adapter (a peft directory: lora.path=... loads it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from flexgemma.config.schema import Config, ConfigError

log = logging.getLogger("flexgemma")


class RewardError(RuntimeError):
    """A reward function raised or returned something TRL cannot train on; names the function and the step."""


class RecordedReward:
    """The user's reward, checked (a list of one finite number, or None, per completion) and keeping the
    last step's values for the metrics. `step`: the optimizer step being computed (the step logger sets it)."""

    def __init__(self, fn):
        self.fn = fn
        inner = getattr(fn, "func", None)  # a partial (Hydra's _partial_) names its function
        self.__name__ = getattr(fn, "__name__", None) or getattr(inner, "__name__", None) or type(fn).__name__
        self.values: list[float] = []
        self.step = 1

    def __call__(self, **kwargs):
        where = f"reward {self.__name__} at step {self.step}"
        try:
            out = self.fn(**kwargs)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        n = len(kwargs.get("completions") or kwargs.get("completion_ids") or [])
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
            raise RewardError(f"{where} returned {out!r:.80} ({type(out).__name__}): it must return a list of {n} "
                              "floats, one per completion (None where the reward does not apply)")
        out = list(out)
        if len(out) != n:
            raise RewardError(f"{where} returned {len(out)} values for {n} completions: one per completion")
        for i, v in enumerate(out):
            if v is not None and not _finite_number(v):
                raise RewardError(f"{where} returned {v!r:.40} ({type(v).__name__}) for completion {i}: each value "
                                  "must be a finite number (or None where the reward does not apply)")
        self.values = [float(v) for v in out if v is not None]
        return out


def _finite_number(v) -> bool:
    if isinstance(v, (str, bytes)):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def make_reward(cfg):
    from hydra.utils import instantiate

    spec = cfg.task.reward
    if spec is None or "_target_" not in spec:
        raise ConfigError("task.reward must be a Hydra node with _target_ (e.g. flexgemma.rl.rewards.TargetTokens)")
    return RecordedReward(instantiate(spec))


def _answers(cfg) -> list | None:
    """The `answer` field of each JSONL record, in the workload's order (None without a file)."""
    w = cfg.workload
    if not w.path:
        return None
    out = []
    with open(Path(str(w.path)).expanduser()) as f:
        for line in f:
            if not line.strip():
                continue
            if w.num_prompts is not None and len(out) >= w.num_prompts:
                break
            record = json.loads(line)
            out.append(record.get("answer") if isinstance(record, dict) else None)
    return out if any(a is not None for a in out) else None


def build_dataset(engine, workload, cfg, tokenizer):
    """A datasets.Dataset of the workload's prompts (prompt text, prompt_token_ids, answer) and the
    text -> ids map the rollout uses (never re-tokenised)."""
    from datasets import Dataset

    from flexgemma.rl.tokenizer import ids_to_text

    first = {}
    for req, src in enumerate(workload.prompt_index):
        first.setdefault(src, req)
    ids = [workload.prompts[first[i]] for i in sorted(first)]
    own = engine.tokenizer is not None
    sources = [workload.sources[i] if i < len(workload.sources) else None for i in sorted(first)]
    # a JSONL prompt's own text (what TRL's generator tokenises the same way); else the ids spelled out
    texts = [src if isinstance(src, str) else tokenizer.decode(p) if own else ids_to_text(p)
             for src, p in zip(sources, ids)]
    if len(set(texts)) != len(texts):
        raise ConfigError("two workload prompts have the same text: use more distinct prompts (workload.seed)")
    rows = {"prompt": texts, "prompt_token_ids": ids}
    answers = _answers(cfg)
    if answers is not None:
        rows["answer"] = answers[: len(ids)]
    by_text = dict(zip(texts, ids))
    return Dataset.from_dict(rows), by_text.__getitem__


def pool_demand(cfg):
    """The KV pool a step needs: every completion of the step in flight, each as long as the longest
    prompt plus task.max_new_tokens (a prompts file's lengths are unknown before its tokenizer)."""
    from flexgemma.engine.kv_cache import PoolDemand

    t, w = cfg.task, cfg.workload
    tokens = None if w.path else int(w.max_prompt_len) + int(t.max_new_tokens)
    return PoolDemand(int(t.prompts_per_step) * int(t.num_generations), tokens)


def grpo_args(cfg, out_dir: Path, device: torch.device, world_size: int = 1):
    from trl import GRPOConfig

    t = cfg.task
    if int(t.prompts_per_step) % world_size:
        raise ConfigError(f"task.prompts_per_step={t.prompts_per_step} must be a multiple of the {world_size} ranks "
                          "(each rank generates whole groups for its share of the step's prompts)")
    # per rank: TRL's per-device batch; accelerate gives each rank a consecutive block of the step's rows
    batch = int(t.prompts_per_step) // world_size * int(t.num_generations)
    micro = int(t.micro_batch) if t.micro_batch else batch
    if micro < 1 or batch % micro:
        raise ConfigError(f"task.micro_batch={t.micro_batch} must divide a rank's {batch} completions "
                          f"(prompts_per_step / ranks x num_generations, {world_size} rank(s))")
    # one rollout of `batch` completions per rank per optimizer step, trained in batch / micro backward passes
    return GRPOConfig(
        output_dir=str(out_dir / "trainer"), max_steps=int(t.steps), learning_rate=float(t.learning_rate),
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1,
        num_generations=int(t.num_generations), max_completion_length=int(t.max_new_tokens),
        temperature=float(t.temperature), beta=float(t.beta), loss_type=str(t.loss_type),
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to="none",
        save_strategy="steps" if int(t.save_every) else "no", save_steps=int(t.save_every) or 500,
        save_total_limit=int(t.keep_checkpoints),
        disable_tqdm=True, seed=int(cfg.seed), use_cpu=device.type == "cpu", bf16=False, fp16=False,
        remove_unused_columns=False, dataloader_num_workers=0, shuffle_dataset=True,
        vllm_importance_sampling_clip_max=float(t.is_clip_max),
        # TRL's flag checkpoints transformers' forward; the engine's forward takes it in rl/rollout.py
        gradient_checkpointing=bool(t.gradient_checkpointing) and t.trainer_forward == "transformers",
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _shard(prompts: list) -> list:
    """A rank's rollout rows as runs [prompt digest, rows in a row]: whole groups read [[a, G], [b, G], ...]."""
    runs: list = []
    for p in prompts:
        key = hashlib.sha256(repr(p).encode()).hexdigest()[:12]
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    return runs


def _memory_fields(rollout) -> dict:
    """This rank's GPU memory at a step's end: allocated now, the rollout's peak and the trainer's since
    (closing the train phase), and under task.engine_sleep the wake before the rollout."""
    out = {"memory/allocated_gib": torch.cuda.memory_allocated() / 2**30} if torch.cuda.is_available() else {}
    if rollout is None:
        return out
    rollout.peaks.close("train")
    out.update({f"memory/{p}_peak_gib": rollout.peaks.gib[p] for p in ("rollout", "train") if p in rollout.peaks.gib})
    rollout.peaks.gib.clear()  # a step that reuses an earlier rollout (num_iterations > 1) logs none
    if rollout.sleep:
        out["grpo/wake_ms"] = rollout.last.get("wake_ms", float("nan"))
    return out


def _step_fields(red: dict) -> dict:
    """A step's row from every rank's reduced part (flexgemma/rl/ranks.py: reduce_step)."""
    vals, rollout_s, step_s = red["rewards"], red["rollout_s"], red["step_s"]
    row = {
        "grpo/reward_mean": statistics.fmean(vals) if vals else float("nan"),
        "grpo/reward_std": statistics.pstdev(vals) if len(vals) > 1 else 0.0,
        "grpo/rollout_s": rollout_s, "grpo/train_s": step_s - rollout_s, "grpo/step_s": step_s,
        "grpo/rollout_tok_s": red["rollout_tokens"] / rollout_s if rollout_s > 0 else float("nan"),
        "grpo/refresh_ms": red["refresh_ms"],
        # the engine's generate() alone: rollout_s beside it also holds TRL's own work and the LoRA refresh
        "grpo/generate_s": red["generate_s"],
    }
    for k in ("logprob_absdiff_mean", "logprob_absdiff_max", "kl_k3", "is_ratio_p99", "is_ratio_max",
              "router_flip_rate"):
        row[f"grpo/{k}"] = red[k]
    return row


def _compile_fields(compiled: dict, step: int) -> dict:
    """What this rank compiled during the step (its time includes it); said on the console after step 1,
    where every new shape should have been seen."""
    out = {"grpo/compiled_graphs": compiled["graphs"]}
    if compiled["kernels"] >= 0:
        out["grpo/compiled_kernels"] = compiled["kernels"]
    if step > 1 and (compiled["graphs"] or compiled["kernels"] > 0):
        names = ", ".join(f"{k} x{n}" for k, n in sorted(compiled["kernel_names"].items()))
        log.info("grpo step %d compiled %d torch.compile graphs and %d Triton kernels%s: its time includes them",
                 step, compiled["graphs"], max(compiled["kernels"], 0), f" ({names})" if names else "")
    return out


def make_step_logger(trainer_ref: list, reward: RecordedReward, recorder, rows: list):
    """A TrainerCallback writing one metrics.jsonl row per optimizer step (rank 0; the row reduces every
    rank's part) and checking the ranks' adapters equal after the step (ranks.jsonl: shards, digests)."""
    from transformers import TrainerCallback

    from flexgemma.model.compiled import CompileWatch
    from flexgemma.rl import ranks

    class StepLogger(TrainerCallback):
        compiles = CompileWatch()

        def on_step_begin(self, args, state, control, **kw):
            _sync()
            self.compiles.start()
            self.t0 = time.perf_counter()
            reward.step = state.global_step + 1

        def on_save(self, args, state, control, **kw):
            save_rows(rows, Path(args.output_dir) / f"checkpoint-{state.global_step}")

        def on_step_end(self, args, state, control, **kw):
            _sync()
            step_s = time.perf_counter() - self.t0
            trainer = trainer_ref[0]
            stats, rollout = trainer.close_step_stats(), trainer.rollout_func
            w = ranks.world()
            # one process: nothing to compare, and hashing a large adapter would only cost time
            digest = ranks.adapter_digest(trainer_ref[1].lora.slots) if w.size > 1 else ""
            if w.size > 1:
                log.info("grpo step %d rank %d/%d: adapter sha256 %s", state.global_step, w.rank, w.size,
                         digest[:16])
            mine = {**stats, "rewards": reward.values, "step_s": step_s, "digest": digest,
                    "refresh_ms": rollout.last.get("refresh_ms", float("nan")) if rollout else float("nan"),
                    "generate_s": rollout.last.get("generate_s", float("nan")) if rollout else float("nan"),
                    "shard": _shard(rollout.last.get("prompts", [])) if rollout else []}
            parts = ranks.gather(mine)
            digests = [p["digest"] for p in parts]
            ranks.check_equal(state.global_step, digests)
            red = ranks.reduce_step(parts)
            step_s, rollout_s = red["step_s"], red["rollout_s"]
            row = {"grpo/step": state.global_step, **_step_fields(red), **_memory_fields(rollout)}
            row.update(_compile_fields(self.compiles.stop(), state.global_step))
            rows.append(row)
            recorder.log_round(row)
            if w.size > 1 and w.is_main:  # who generated what, and the adapter every rank ended the step with
                with open(recorder.dir / "ranks.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step, "adapter_sha256": digests,
                                        "shards": [p["shard"] for p in parts]}) + "\n")
            log.info("grpo step %d/%d: reward %.3f, step %.2f s (rollout %.2f s, train %.2f s, refresh %.1f ms), "
                     "|dlogp| %.2g", state.global_step, state.max_steps, row["grpo/reward_mean"], step_s, rollout_s,
                     row["grpo/train_s"], row["grpo/refresh_ms"], row["grpo/logprob_absdiff_mean"])

    return StepLogger()


ROWS_FILE = "flexgemma_rows.json"  # in a checkpoint: the metrics rows of the steps before it


class GrpoFailed(RuntimeError):
    """task=grpo stopped at a step; the message says where its last checkpoint is."""


def checkpoints(trainer_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the complete checkpoints under trainer_dir, oldest first (a checkpoint is
    complete once its trainer_state.json is written, after the adapter, optimizer and RNG states)."""
    found = []
    for d in trainer_dir.glob("checkpoint-*"):
        step = d.name.removeprefix("checkpoint-")
        if step.isdigit() and (d / "trainer_state.json").is_file():
            found.append((int(step), d))
    return sorted(found)


def resume_point(t, trainer_dir: Path) -> Optional[Path]:
    """The checkpoint a run continues from (task.resume: null continues from the last one if any)."""
    found = checkpoints(trainer_dir)
    if t.resume is False and found:
        raise ConfigError(f"task.resume=false but {trainer_dir} holds checkpoints of an earlier run (the last at step "
                          f"{found[-1][0]}): remove them, use another job directory, or leave task.resume unset to "
                          "continue from the last")
    if t.resume is True and not found:
        raise ConfigError(f"task.resume=true but {trainer_dir} holds no checkpoint (checkpoint-<step>/"
                          "trainer_state.json): save some with task.save_every=N")
    return found[-1][1] if found else None


def save_rows(rows: list, checkpoint: Path) -> None:
    """The metrics rows so far, into a checkpoint (rank 0): a resumed run's metrics.jsonl starts with them."""
    from flexgemma.rl import ranks

    if ranks.world().is_main:
        (checkpoint / ROWS_FILE).write_text(json.dumps(rows))


def _restore_rows(resume: Optional[Path], rows: list, recorder) -> None:
    """The metrics rows of the steps before the checkpoint, into this run's metrics.jsonl (and W&B)."""
    if resume is None or not (resume / ROWS_FILE).is_file():
        return
    for row in json.loads((resume / ROWS_FILE).read_text()):
        rows.append(row)
        recorder.log_round(row)
    log.info("grpo: continuing from %s (step %d)", resume, len(rows))


def _train(trainer, resume: Optional[Path], trainer_dir: Path) -> None:
    """trainer.train(), from `resume` when given; a failure says which step and where the last checkpoint is."""
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except BaseException as e:
        found = checkpoints(trainer_dir)
        where = (f"the last checkpoint is {found[-1][1]} (step {found[-1][0]}): re-run the same job directory (or "
                 "task.resume=true) to continue from it" if found
                 else "no checkpoint was saved (task.save_every=N saves one every N steps)")
        step = trainer.state.global_step + 1
        if isinstance(e, (ConfigError, KeyboardInterrupt)) or not isinstance(e, Exception):
            log.error("grpo stopped at step %d: %s", step, where)
            raise
        raise GrpoFailed(f"task=grpo failed at step {step}: {type(e).__name__}: {e}; {where}") from e


def summarise(rows: list[dict]) -> dict:
    # a key's values, NaN dropped, rows without it skipped: some keys only some jobs log (GPU memory,
    # task.engine_sleep), and a resumed run's earlier rows may come from a version that logged fewer
    def col(k):
        return [r[k] for r in rows if k in r and r[k] == r[k]]

    def mean(k, sl=slice(None)):
        v = col(k)[sl]
        return statistics.fmean(v) if v else float("nan")

    step_s, rollout_s = col("grpo/step_s"), col("grpo/rollout_s")
    out = {
        "grpo/steps": len(rows),
        "grpo/reward_first5": mean("grpo/reward_mean", slice(0, 5)),
        "grpo/reward_last5": mean("grpo/reward_mean", slice(-5, None)),
        "grpo/step_s_median": statistics.median(step_s) if step_s else float("nan"),
        "grpo/rollout_share": sum(rollout_s) / sum(step_s) if step_s and rollout_s else float("nan"),
    }
    for k in ("rollout_s", "generate_s", "train_s", "refresh_ms", "rollout_tok_s"):
        v = col(f"grpo/{k}")
        out[f"grpo/{k}_median"] = statistics.median(v) if v else float("nan")
    out["grpo/logprob_absdiff_mean"] = mean("grpo/logprob_absdiff_mean")
    v = col("grpo/logprob_absdiff_max")
    out["grpo/logprob_absdiff_max"] = max(v) if v else float("nan")
    out["grpo/kl_k3"] = mean("grpo/kl_k3")
    out["grpo/router_flip_rate"] = mean("grpo/router_flip_rate")
    v = col("grpo/is_ratio_max")
    out["grpo/is_ratio_max"] = max(v) if v else float("nan")
    for k in ("memory/rollout_peak_gib", "memory/train_peak_gib"):
        if col(k):
            out[k] = max(col(k))
    if col("grpo/wake_ms"):
        out["grpo/wake_ms_median"] = statistics.median(col("grpo/wake_ms"))
    # the steady state: steps that compiled nothing (the first steps compile each new shape they meet)
    warm = [r for r in rows if r.get("grpo/compiled_graphs", 1) == 0 and r.get("grpo/compiled_kernels", 0) <= 0]
    out["grpo/compiling_steps"] = len(rows) - len(warm)
    for k in ("step_s", "train_s"):
        v = [r[f"grpo/{k}"] for r in warm if r[f"grpo/{k}"] == r[f"grpo/{k}"]]
        out[f"grpo/{k}_median_warm"] = statistics.median(v) if v else float("nan")
    return out


def _run_facts(t, generator: str, trainer, shared, rollout, ranks: int) -> dict:
    """The summary's description of the run: its keys, the bytes it held, the job's peak memory."""
    opt_bytes = sum(v.numel() * v.element_size() for st in trainer.optimizer.state.values()
                    for v in st.values() if torch.is_tensor(v))
    out = {"grpo/generator": generator, "grpo/trainer_forward": str(t.trainer_forward),
           "grpo/gradient_checkpointing": bool(t.gradient_checkpointing), "grpo/ratio_forward": str(t.ratio_forward),
           "grpo/engine_sleep": bool(t.engine_sleep), "grpo/optimizer_state_bytes": opt_bytes, "grpo/ranks": ranks,
           **{f"grpo/{k}": v for k, v in shared.base_bytes().items()}}
    if rollout is not None and rollout.peaks.on:  # the job's peak across the phases' counter resets
        out["memory/peak_allocated_gib"] = max(rollout.peaks.overall, torch.cuda.max_memory_allocated()) / 2**30
    return out


def _checked_generator(cfg: Config) -> str:
    """task.generator, after the checks of the task's keys against each other and the engine's."""
    t = cfg.task
    generator = str(getattr(t.generator, "value", t.generator))
    if generator not in ("flexgemma", "trl"):
        raise ConfigError(f"task.generator={generator!r}: choose flexgemma or trl")
    if str(t.loss_type) == "vespo" and bool(t.is_correction):
        raise ConfigError("task.loss_type=vespo is not linear in the advantage: set task.is_correction=false")
    if t.engine_sleep and not cfg.engine.sleep_mode and torch.cuda.is_available():
        log.warning("task.engine_sleep without engine.sleep_mode: a wake whose KV pool lands elsewhere captures the "
                    "decode graphs again (seconds a step); add engine.sleep_mode=true")
    return generator


def run(engine, workload, cfg: Config, recorder) -> dict:
    from flexgemma.config.extras import require

    require("trl", "rl", "task=grpo")
    require("datasets", "rl", "task=grpo")
    from transformers import PrinterCallback

    from flexgemma.rl import ranks
    from flexgemma.rl.rollout import grpo_trainer
    from flexgemma.rl.tokenizer import tiny_tokenizer

    t = cfg.task
    generator = _checked_generator(cfg)
    tokenizer = engine.tokenizer or tiny_tokenizer(engine.spec.vocab_size)
    dataset, ids_of = build_dataset(engine, workload, cfg, tokenizer)
    if len(dataset) < int(t.prompts_per_step):
        raise ConfigError(f"task.prompts_per_step={t.prompts_per_step} but the workload has {len(dataset)} prompts: "
                          "raise workload.num_prompts")
    device = next(engine.model.parameters()).device
    reward = make_reward(cfg)
    rows: list[dict] = []
    ref: list = []
    logger = make_step_logger(ref, reward, recorder, rows)
    w = ranks.world()
    if w.size > 1 and w.is_main:
        (recorder.dir / "ranks.jsonl").write_text("")  # a re-run starts its lines afresh, as metrics.jsonl does
    trainer, shared, rollout = grpo_trainer(
        engine, grpo_args(cfg, recorder.dir, device, w.size), [reward], dataset, tokenizer, ids_of, generator,
        bool(t.is_correction), callbacks=[logger], rank=w.rank, world_size=w.size,
        trainer_forward=str(t.trainer_forward), routing_replay=bool(t.routing_replay),
        gradient_checkpointing=bool(t.gradient_checkpointing), ratio_forward=str(t.ratio_forward),
        engine_sleep=bool(t.engine_sleep))
    ref.extend([trainer, shared])
    trainer.remove_callback(PrinterCallback)  # TRL's per-step dict print; the rows go to metrics.jsonl
    resume = resume_point(t, recorder.dir / "trainer")
    _restore_rows(resume, rows, recorder)
    t0 = time.perf_counter()
    try:
        _train(trainer, resume, recorder.dir / "trainer")
    finally:  # the engine serves again, also after a failed step (task.engine_sleep leaves it asleep)
        if rollout is not None:
            rollout.wake()
    train_wall = time.perf_counter() - t0
    summary = {**summarise(rows), **_run_facts(t, generator, trainer, shared, rollout, w.size), "grpo/wall_s": train_wall}
    # the engine ends with the trained adapter: what the saved directory reloads to
    shared.engine_view()
    engine.update_lora(shared.peft_model)
    adapter_dir = recorder.dir / "adapter"
    if w.is_main:  # the ranks' adapters are equal (checked every step): one copy
        engine.lora.save(adapter_dir)
    summary["grpo/adapter_path"] = str(adapter_dir)
    log.info("grpo: reward %.3f (first 5 steps) -> %.3f (last 5); step %.2f s median, rollout share %.2f; "
             "adapter saved to %s" + ("" if w.is_main else " by rank 0"), summary["grpo/reward_first5"], summary["grpo/reward_last5"],
             summary["grpo/step_s_median"], summary["grpo/rollout_share"], adapter_dir)
    return summary
