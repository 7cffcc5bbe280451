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
mismatch statistics are kept for the metrics. With the engine's forward the ratio comes by default from
each micro-batch's loss forward instead (ratio_forward="loss"): the same weights, one forward fewer.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, Optional

import torch

from flexgemma.engine.sequence import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhasePeaks:
    """The peak GPU memory of each phase of a GRPO step (rollout, train): torch's peak counter, reset as
    each phase closes; `overall` keeps the job's peak across the resets. Nothing for an engine on the CPU."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"
        self.overall = torch.cuda.max_memory_allocated() if self.on else 0
        self.gib: dict[str, float] = {}

    def close(self, phase: str) -> None:
        """The peak since the last close is `phase`'s; the next phase starts."""
        if not self.on:
            return
        peak = torch.cuda.max_memory_allocated()
        self.overall = max(self.overall, peak)
        self.gib[phase] = peak / 2**30
        torch.cuda.reset_peak_memory_stats()


class EngineRollout:
    """rollout_func(prompts, trainer) -> {prompt_ids, completion_ids, logprobs}.

    prompt_ids_of: text prompt -> token ids (the dataset's own ids, so a prompt is never re-tokenised
    differently from what the trainer scores). Timings of the last call are in `last`; each phase's peak
    memory in `peaks`. sleep: the engine gives its KV cache back after each rollout (engine.sleep) and
    takes it again before the next (wake), so the trainer computes without it.
    """

    def __init__(self, engine, shared, prompt_ids_of: Callable[[str], list[int]], max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 rank: int = 0, world_size: int = 1, sleep: bool = False):
        self.engine, self.shared, self.prompt_ids_of, self.sleep = engine, shared, prompt_ids_of, sleep
        self.peaks = PhasePeaks(engine.runner.device)
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.calls = 0
        self.last: dict[str, float] = {}
        # MoE models: the last rollout's routed experts by sequence (prompt + completion ids), for the trainer's
        # router flip rate and routing replay
        self.moe = any(s.moe for s in engine.spec.layers)
        self.routed_by_seq: dict[tuple, object] = {}

    def __call__(self, prompts: list, trainer) -> dict:
        ids = [list(self.prompt_ids_of(p)) for p in prompts]
        state = getattr(trainer, "state", None)
        if state is not None:  # a run resumed at step k draws the seeds of step k + 1, as one that never stopped
            self.calls = max(self.calls, int(state.global_step))
        # every row of every rank and step its own seed (ranks hold equal-sized shards of a step)
        base = (self.seed * 1_000_003 + (self.calls * self.world_size + self.rank) * len(ids)) & 0x3FFFFFFF
        params = [SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                                 top_p=self.top_p, seed=base + i, return_routed_experts=self.moe)
                  for i in range(len(ids))]
        self.calls += 1
        self.peaks.close("before_rollout")
        wake_ms = self.wake()
        with self.shared.engine_side():
            refresh = self.engine.update_lora(self.shared.peft_model)
            _sync()
            t0 = time.perf_counter()
            outs = self.engine.generate(ids, params, strict=True)
            _sync()
            gen_s = time.perf_counter() - t0
        if self.sleep:
            self.engine.sleep()
        self.peaks.close("rollout")
        tokens = sum(len(o.token_ids) for o in outs)
        self.last = {"refresh_ms": refresh["refresh_ms"], "generate_s": gen_s, "tokens": float(tokens),
                     "prompts": list(prompts), "wake_ms": wake_ms}
        self.routed_by_seq = {tuple(i + o.token_ids): o.routed_experts for i, o in zip(ids, outs)} if self.moe else {}
        return {"prompt_ids": ids, "completion_ids": [o.token_ids for o in outs],
                "logprobs": [o.logprobs for o in outs]}

    def wake(self) -> float:
        """The engine awake (after a sleep of the last rollout); milliseconds it took (0: it was awake)."""
        if not self.engine.asleep:
            return 0.0
        t0 = time.perf_counter()
        self.engine.wake()
        return (time.perf_counter() - t0) * 1e3


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
    # float64: k3 of ratios within 1e-6 of 1 rounds to 0 in float32; sorted: the sums are over a set of
    # tokens, equal whichever micro-batches or order they came in
    lr = log_r[m].double().sort().values
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


def router_flip_rate(pairs: list[tuple]) -> float:
    """Share of (token, MoE layer) whose set of routed experts differs between the rollout and the trainer:
    pairs of uint8 [tokens, layers, k] arrays (rollout, trainer), NaN when there are none."""
    import numpy as np

    flips = total = 0
    for a, b in pairs:
        if a is None or b is None:
            continue
        n = min(len(a), len(b))
        differ = (np.sort(a[:n], axis=-1) != np.sort(b[:n], axis=-1)).any(axis=-1)
        flips, total = flips + int(differ.sum()), total + differ.size
    return flips / total if total else float("nan")


class RouterHooks:
    """transformers' forward: each Gemma-4 router's top-k expert ids, in layer order (forward hooks)."""

    def __init__(self, model):
        self.model, self.index, self.handles = model, [], []

    def __enter__(self):
        for m in self.model.modules():
            if type(m).__name__ == "Gemma4TextRouter":
                self.handles.append(m.register_forward_hook(lambda mod, args, out: self.index.append(out[2])))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def rows(self, attention_mask: torch.Tensor, keep: int) -> list:
        """Per TRL row, uint8 [completion tokens, layers, k] of the rows that scored its completion (the
        forward ran its rows in chunks: each chunk's layers in order)."""
        if not self.index:
            return []
        length, layers = attention_mask.shape[1], len(self.handles)
        chunks = [torch.stack([i.reshape(i.shape[0] // length, length, -1) for i in self.index[c: c + layers]], dim=2)
                  for c in range(0, len(self.index), layers)]
        ids = torch.cat(chunks)  # [B, L, layers, k]
        counts = attention_mask[:, -keep:].sum(-1).tolist()
        return [ids[r, length - keep - 1: length - keep - 1 + c].to(torch.uint8).cpu().numpy()
                for r, c in enumerate(counts)]


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int) -> tuple[list[list[int]], list[int]]:
    """TRL's rows (prompt left-padded, completion right-padded, the completion the last `keep` columns)
    as token lists and the index of each row's first completion token."""
    seqs, firsts = [], []
    for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist()):
        prompt = [t for t, m in zip(ids[:-keep], mask[:-keep]) if m]
        completion = [t for t, m in zip(ids[-keep:], mask[-keep:]) if m]
        seqs.append(prompt + completion)
        firsts.append(len(prompt))
    return seqs, firsts


def engine_logps(forward, shared, input_ids, attention_mask, keep: int, batch_size: int, entropy: bool,
                 replay_of: Optional[dict] = None, routed_out: Optional[list] = None):
    """TRL's (logps [B, keep], entropies or None, aux loss None) through the engine's forward, `batch_size`
    rows at a time; padding positions hold 0. MoE models: `replay_of` (sequence -> the rollout's routed
    experts) replays the rollout's routing (R3); `routed_out` receives (sequence, the trainer's routing)."""
    logps = torch.zeros(input_ids.shape[0], keep, dtype=torch.float32, device=input_ids.device)
    ents = torch.zeros_like(logps) if entropy else None
    for start in range(0, input_ids.shape[0], batch_size):
        seqs, firsts = unpad(input_ids[start: start + batch_size], attention_mask[start: start + batch_size], keep)
        scored = [i for i, (s, f) in enumerate(zip(seqs, firsts)) if len(s) > f]  # rows with a completion token
        shared.merged_for_training()
        replay = [replay_of.get(tuple(seqs[i])) for i in scored] if replay_of is not None else None
        lps, es = forward.token_logprobs([seqs[i] for i in scored], [firsts[i] for i in scored], entropy, replay)
        if routed_out is not None and forward.last_routed is not None:
            routed_out.extend((tuple(seqs[i]), r) for i, r in zip(scored, forward.last_routed))
        for j, i in enumerate(scored):
            n = lps[j].shape[0]
            logps[start + i, :n] = lps[j]
            if entropy:
                ents[start + i, :n] = es[j]
    return logps, ents, None


def trainer_logps_and_flips(trainer, ids, attn, keep: int):
    """The trainer's logprobs of the rollout (no gradient) and, on MoE models, its router flip rate: the
    engine's forward reports its routing, transformers' is read by router hooks."""
    rollout = trainer.rollout_func
    moe = rollout is not None and rollout.moe
    engine_forward = trainer.engine_forward is not None
    trainer._routed = [] if moe and engine_forward else None
    hooks = RouterHooks(trainer.model) if moe and not engine_forward else nullcontext()
    with torch.no_grad(), hooks:
        trainer_lp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, keep, batch_size=trainer.args.per_device_train_batch_size)
    flips = float("nan")
    if moe:
        seqs = [tuple(seq) for seq in unpad(ids, attn, keep)[0]]
        mine = trainer._routed if engine_forward else list(zip(seqs, hooks.rows(attn, keep)))
        flips = router_flip_rate([(rollout.routed_by_seq.get(seq), r) for seq, r in mine])
    trainer._routed = None
    return trainer_lp, flips


class EngineGRPOMixin:
    """What FlexGemmaGRPOTrainer adds to TRL's GRPOTrainer (a mixin placed before it, so that super() is
    GRPOTrainer): the engine's importance-sampling correction and per-step mismatch/timing stats."""

    def __init__(self, *args, is_correction: bool = True, engine_forward=None, shared=None,
                 routing_replay: bool = False, ratio_forward: str = "separate", **kwargs):
        super().__init__(*args, **kwargs)
        self.is_correction = is_correction
        self.step_stats: dict[str, float] = {}
        # task.trainer_forward=engine: a model.trainable.TrainableForward (None: transformers' forward)
        self.engine_forward, self.shared, self.routing_replay = engine_forward, shared, routing_replay
        self._routed: Optional[list] = None  # (sequence, trainer routing) pairs while the IS forward runs
        # task.ratio_forward=loss: the IS ratio from each micro-batch's loss forward (the weights a rollout
        # trains with are the ones it sampled with only while each rollout makes one optimizer step)
        self.ratio_in_loss = ratio_forward == "loss"
        if self.ratio_in_loss and (engine_forward is None or self.num_iterations != 1
                                   or self.args.steps_per_generation > self.args.gradient_accumulation_steps):
            raise ValueError("ratio_forward='loss' needs the engine's forward and one optimizer step a rollout "
                             "(num_iterations=1, steps_per_generation <= gradient_accumulation_steps)")
        self._loss_inputs: Optional[dict] = None  # the micro-batch whose loss forward runs now
        self._step_parts: list = []  # (trainer logps, engine logps, mask) of this step's micro-batches

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        if self.engine_forward is None or kwargs.get("pixel_values") is not None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **kwargs)
        replay_of = self.rollout_func.routed_by_seq if self.routing_replay and self.rollout_func else None
        inputs = self._loss_inputs
        if inputs is not None and self._routed is None and self.rollout_func is not None and self.rollout_func.moe:
            self._routed = []
        out = engine_logps(self.engine_forward, self.shared, input_ids, attention_mask, logits_to_keep,
                           batch_size or input_ids.size(0), compute_entropy, replay_of, self._routed)
        if inputs is not None and inputs.get("sampling_per_token_logps") is not None:
            self._ratio_from_loss_forward(inputs, out[0].detach())
        return out

    def _ratio_from_loss_forward(self, inputs: dict, trainer_lp: torch.Tensor) -> None:
        """ratio_forward=loss: this micro-batch's IS ratio from its loss forward, folded into the advantages
        TRL reads after this forward; the step's mismatch statistics are taken over all its micro-batches."""
        engine_lp, mask = inputs["sampling_per_token_logps"], inputs["completion_mask"]
        self._step_parts.append((trainer_lp, engine_lp, mask))
        if self.is_correction:
            a = self.args
            ratio, _ = mismatch_stats(trainer_lp, engine_lp, mask, a.vllm_importance_sampling_clip_min,
                                      a.vllm_importance_sampling_clip_max)
            adv = inputs["advantages"]
            inputs["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio.to(adv.dtype)

    def _compute_loss(self, model, inputs):
        if not self.ratio_in_loss:
            return super()._compute_loss(model, inputs)
        self._loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def close_step_stats(self) -> dict:
        """This step's statistics (ratio_forward=loss: the mismatch over every micro-batch's loss forward);
        the next step starts empty."""
        stats, self.step_stats = self.step_stats, {}
        parts, self._step_parts = self._step_parts, []
        if parts:
            a = self.args
            _, mism = mismatch_stats(*(torch.cat(p) for p in zip(*parts)), a.vllm_importance_sampling_clip_min,
                                     a.vllm_importance_sampling_clip_max)
            stats.update(mism)
        if self.ratio_in_loss and self.rollout_func is not None and self.rollout_func.moe:
            routed, self._routed = self._routed or [], None
            stats["router_flip_rate"] = router_flip_rate([(self.rollout_func.routed_by_seq.get(seq), r)
                                                          for seq, r in routed])
        return stats

    def _trainer_logps_and_flips(self, ids, attn, keep: int):
        return trainer_logps_and_flips(self, ids, attn, keep)

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
        if engine_lp is None or self.use_vllm or self.ratio_in_loss:
            return out
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        trainer_lp, flips = self._trainer_logps_and_flips(ids, attn, out["completion_ids"].size(1))
        a = self.args
        ratio, stats = mismatch_stats(trainer_lp, engine_lp, out["completion_mask"],
                                      a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max)
        self.step_stats.update(stats, router_flip_rate=flips)
        if self.is_correction:
            adv = out["advantages"]
            out["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio.to(adv.dtype)
            out["old_per_token_logps"] = trainer_lp  # the PPO ratio is the trainer's own, as on TRL's vLLM path
        return out


def make_trainer_class():
    """FlexGemmaGRPOTrainer (built on first use: TRL is an optional extra)."""
    from trl import GRPOTrainer

    class FlexGemmaGRPOTrainer(EngineGRPOMixin, GRPOTrainer):
        """GRPOTrainer + the engine's importance-sampling correction and per-step mismatch/timing stats."""

    return FlexGemmaGRPOTrainer


def grpo_trainer(engine, args, reward_funcs, train_dataset, processing_class=None, prompt_ids_of=None,
                 generator: str = "flexgemma", is_correction: bool = True, callbacks=None, rank: int = 0,
                 world_size: int = 1, trainer_forward: str = "transformers", routing_replay: bool = False,
                 gradient_checkpointing: bool = True, ratio_forward: str = "separate", engine_sleep: bool = False):
    """A FlexGemmaGRPOTrainer training `engine`'s LoRA adapter (one model: see shared.SharedModel),
    generating through the engine (generator="flexgemma") or with TRL's transformers generate ("trl").

    args: a trl.GRPOConfig (its temperature and max_completion_length drive the engine too).
    prompt_ids_of: prompt (text or chat messages) -> token ids; default: as TRL tokenises them.
    rank, world_size: this process's place under torchrun/accelerate (flexgemma/rl/ranks.py); they only
    keep the rollout seeds of the ranks apart.
    trainer_forward: "engine" computes the trainer's logprobs through the engine's forward (model/trainable.py;
    the engine built with engine.batch_invariant), "transformers" through the peft model.
    routing_replay: MoE models with trainer_forward="engine": the trainer routes each completion token to the
    experts the rollout routed it to (R3).
    gradient_checkpointing: trainer_forward="engine": recompute each layer in the backward (only each layer's
    input kept); transformers' forward takes TRL's args.gradient_checkpointing instead.
    ratio_forward: "separate" (a no-grad forward after each rollout gives the IS ratio and mismatch metrics)
    or "loss" (trainer_forward="engine": each micro-batch's loss forward gives them; one forward fewer).
    engine_sleep: generator="flexgemma": the engine's KV cache is given back while the trainer computes.
    Returns (trainer, shared, rollout or None)."""
    from flexgemma.rl.shared import SharedModel
    from flexgemma.rl.tokenizer import tiny_tokenizer

    shared = SharedModel(engine, engine_forward=trainer_forward == "engine")
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
                                seed=int(args.seed), rank=rank, world_size=world_size, sleep=engine_sleep)
    engine_forward = None
    if trainer_forward == "engine":
        from flexgemma.model.trainable import TrainableForward

        engine_forward = TrainableForward(engine.runner.forward, engine.lora, checkpoint=gradient_checkpointing)
    trainer = make_trainer_class()(
        model=shared.peft_model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
        processing_class=tokenizer, rollout_func=rollout, callbacks=callbacks,
        is_correction=is_correction and rollout is not None, engine_forward=engine_forward, shared=shared,
        routing_replay=routing_replay, ratio_forward=ratio_forward,
    )
    return trainer, shared, rollout
