"""TRL's GRPOTrainer generating through a flexgemma engine in the same process.

`EngineRollout` is TRL's `rollout_func`: TRL hands it the step's prompts (each prompt repeated
`num_generations` times in a row by its sampler) and the trainer; it switches the shared model to
the engine's view, copies the trainer's current adapter into the engine with `update_lora` (an in-
place rebuild of the merged weights: no re-capture), generates one completion per row with its own
seed, and returns prompt ids, completion ids and the engine's per-token logprobs.

`FlexGemmaGRPOTrainer` adds what TRL 1.16 does only on its vLLM path: the engine-vs-trainer
importance-sampling correction. TRL computes the trainer's logprobs of the sampled tokens and the
truncated ratio exp(trainer - engine) only when `use_vllm=True`; here the same forward runs after
every rollout, the ratio (token level, clipped to [clip_min, clip_max] of the GRPO config) is folded
into the per-token advantages (TRL accepts advantages of shape (B, T); every loss type but vespo is
linear in the advantage, so scaling it is the same as TRL's scaling of the per-token loss), and the
mismatch statistics are kept for the metrics.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from flexgemma.engine.sequence import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class EngineRollout:
    """rollout_func(prompts, trainer) -> {prompt_ids, completion_ids, logprobs}.

    prompt_ids_of: text prompt -> token ids (the dataset's own ids, so a prompt is never re-tokenised
    differently from what the trainer scores). Timings of the last call are in `last`.
    """

    def __init__(self, engine, shared, prompt_ids_of: Callable[[str], list[int]], max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        self.engine, self.shared, self.prompt_ids_of = engine, shared, prompt_ids_of
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.calls = 0
        self.last: dict[str, float] = {}

    def __call__(self, prompts: list, trainer) -> dict:
        ids = [list(self.prompt_ids_of(p)) for p in prompts]
        state = getattr(trainer, "state", None)
        if state is not None:  # a run resumed at step k draws the seeds of step k + 1, as one that never stopped
            self.calls = max(self.calls, int(state.global_step))
        # every row of every rank and step its own seed (ranks hold equal-sized shards of a step)
        base = (self.seed * 1_000_003 + (self.calls * self.world_size + self.rank) * len(ids)) & 0x3FFFFFFF
        params = [SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                                 top_p=self.top_p, seed=base + i) for i in range(len(ids))]
        self.calls += 1
        with self.shared.engine_side():
            refresh = self.engine.update_lora(self.shared.peft_model)
            _sync()
            t0 = time.perf_counter()
            outs = self.engine.generate(ids, params, strict=True)
            _sync()
            gen_s = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        self.last = {"refresh_ms": refresh["refresh_ms"], "generate_s": gen_s, "tokens": float(tokens),
                     "prompts": list(prompts)}
        return {"prompt_ids": ids, "completion_ids": [o.token_ids for o in outs],
                "logprobs": [o.logprobs for o in outs]}


def mismatch_stats(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor,
                   clip_min: Optional[float], clip_max: Optional[float]) -> tuple[torch.Tensor, dict]:
    """(clipped token-level IS ratio exp(trainer - engine) [B, T], statistics over the masked tokens).

    kl_k3 is the k3 estimator of KL(engine || trainer) per token on engine samples:
    r - 1 - log r with r = p_trainer / p_engine."""
    m = mask.bool() & ~torch.isnan(engine_lp)
    log_r = torch.nan_to_num((trainer_lp - engine_lp).float(), nan=0.0) * m
    ratio = torch.exp(log_r)
    clipped = ratio.clamp(min=clip_min if clip_min is not None else 0.0,
                          max=clip_max if clip_max is not None else float("inf"))
    lr = log_r[m].double()  # float64: k3 of ratios within 1e-6 of 1 rounds to 0 in float32
    r = lr.exp()
    if lr.numel() == 0:
        return clipped, {}
    stats = {
        "logprob_absdiff_mean": lr.abs().mean().item(),
        "logprob_absdiff_max": lr.abs().max().item(),
        "kl_k3": (r - 1 - lr).mean().item(),
        "is_ratio_p99": torch.quantile(r, 0.99).item(),
        "is_ratio_max": r.max().item(),
        "is_ratio_clipped_frac": (clipped != ratio)[m].float().mean().item(),
    }
    return clipped, stats


def make_trainer_class():
    """FlexGemmaGRPOTrainer (built on first use: TRL is an optional extra)."""
    from trl import GRPOTrainer

    class FlexGemmaGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + the engine's importance-sampling correction and per-step mismatch/timing stats."""

        def __init__(self, *args, is_correction: bool = True, **kwargs):
            super().__init__(*args, **kwargs)
            self.is_correction = is_correction
            self.step_stats: dict[str, float] = {}

        def _generate(self, prompts):
            _sync()
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            _sync()
            self.step_stats["rollout_s"] = time.perf_counter() - t0
            self.step_stats["rollout_tokens"] = float(sum(len(c) for c in out[1]))
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            engine_lp = out.get("sampling_per_token_logps")
            if engine_lp is None or self.use_vllm:
                return out
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            with torch.no_grad():
                trainer_lp, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, out["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)
            a = self.args
            ratio, stats = mismatch_stats(trainer_lp, engine_lp, out["completion_mask"],
                                          a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max)
            self.step_stats.update(stats)
            if self.is_correction:
                adv = out["advantages"]
                out["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio.to(adv.dtype)
                out["old_per_token_logps"] = trainer_lp  # the PPO ratio is the trainer's own, as on TRL's vLLM path
            return out

    return FlexGemmaGRPOTrainer


def grpo_trainer(engine, args, reward_funcs, train_dataset, processing_class=None, prompt_ids_of=None,
                 generator: str = "flexgemma", is_correction: bool = True, callbacks=None, rank: int = 0,
                 world_size: int = 1):
    """A FlexGemmaGRPOTrainer training `engine`'s LoRA adapter (one model: see shared.SharedModel),
    generating through the engine (generator="flexgemma") or with TRL's transformers generate ("trl").

    args: a trl.GRPOConfig (its temperature and max_completion_length drive the engine too).
    prompt_ids_of: prompt (text or chat messages) -> token ids; default: as TRL tokenises them.
    rank, world_size: this process's place under torchrun/accelerate (flexgemma/rl/ranks.py); they only
    keep the rollout seeds of the ranks apart.
    Returns (trainer, shared, rollout or None)."""
    from flexgemma.rl.shared import SharedModel
    from flexgemma.rl.tokenizer import tiny_tokenizer

    shared = SharedModel(engine)
    tokenizer = processing_class or engine.tokenizer or tiny_tokenizer(engine.spec.vocab_size)
    if prompt_ids_of is None:
        def prompt_ids_of(prompt):  # as TRL tokenises for its own generator
            if isinstance(prompt, str):
                return tokenizer(text=prompt)["input_ids"]
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
            return ids["input_ids"]
    rollout = None
    if generator == "flexgemma":
        rollout = EngineRollout(engine, shared, prompt_ids_of, int(args.max_completion_length),
                                float(args.temperature), top_k=int(args.top_k or 0), top_p=float(args.top_p),
                                seed=int(args.seed), rank=rank, world_size=world_size)
    trainer = make_trainer_class()(
        model=shared.peft_model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
        processing_class=tokenizer, rollout_func=rollout, callbacks=callbacks,
        is_correction=is_correction and rollout is not None,
    )
    return trainer, shared, rollout
