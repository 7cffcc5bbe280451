"""Behaviours that held but no test pinned (issue 36): n > 1 with stops, chunked scoring, the prefix
cache across sleep/wake and weight changes, preemption order, rollout seeds, the IS correction,
and a sweep re-launched over jobs left running or interrupted."""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys

import pytest
import torch

from flexgemma import SamplingParams, build_engine, compose
from flexgemma.engine.sequence import child_seed

from conftest import SMALL, make_engine


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(3, 512) for _ in range(n - 1)]


def assert_n_equals_separate_requests(engine, prompt, params: SamplingParams) -> list:
    """Each completion of one n-sample request equals a request of its own seeded child_seed(seed, i)."""
    out = engine.generate([prompt], params)[0]
    alone = [engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1, "seed": child_seed(params.seed, i)}))[0]
             for i in range(params.n)]
    for i, (c, a) in enumerate(zip(out.outputs, alone)):
        assert (c.token_ids, c.finish_reason, c.text, c.stop_reason) == \
               (a.outputs[0].token_ids, a.outputs[0].finish_reason, a.outputs[0].text, a.outputs[0].stop_reason), i
    return out.outputs


def test_n_samples_with_stop_tokens_each_stop_at_their_own_point(tiny_engine):
    params = SamplingParams(n=6, max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=list(range(3, 60)))
    outs = assert_n_equals_separate_requests(tiny_engine, rand_prompt(random.Random(1), 20), params)
    assert len({len(c.token_ids) for c in outs}) > 2 and {c.finish_reason for c in outs} == {"stop"}


def test_n_samples_with_stop_strings_each_stop_at_their_own_text(checkpoint_with_tokenizer):  # noqa: F811
    engine = build_engine(compose(["+model=tiny", f"model.path={checkpoint_with_tokenizer}", *SMALL]))
    params = SamplingParams(n=6, max_new_tokens=40, temperature=1.0, seed=3, stop=["w12", "w3"])
    outs = assert_n_equals_separate_requests(engine, "hello world the cat", params)
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert len(stopped) >= 3 and len({len(c.token_ids) for c in stopped}) > 1
    assert all(c.stop_reason in ("w12", "w3") and c.stop_reason not in c.text for c in stopped)


def test_chunked_scoring_equals_unchunked():
    rng = random.Random(2)
    seqs = [rand_prompt(rng, n) for n in (70, 45, 90)]
    plens = [30, 5, 60]
    whole = make_engine("engine.max_prefill_tokens=256").score(seqs, plens, top_k=3)
    chunked_engine = make_engine("engine.max_prefill_tokens=16")
    chunked = chunked_engine.score(seqs, plens, top_k=3)
    for w, c in zip(whole, chunked):
        assert w.token_ids == c.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        assert [[t for t, _ in row] for row in c.top_logprobs] == [[t for t, _ in row] for row in w.top_logprobs]


def test_sleep_then_wake_serves_no_page_of_before():
    engine = make_engine("engine.sleep_mode=true")
    prompt = rand_prompt(random.Random(3), 45)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], greedy)
    engine.generate([prompt], greedy)
    assert engine.stats.prefix_hit_tokens == 40
    engine.sleep()
    engine.wake()
    engine.generate([prompt], greedy)
    assert engine.stats.prefix_hit_tokens == 0


def test_a_preempted_request_is_readmitted_before_later_arrivals():
    """Three requests fill the batch; a fourth arrives and waits; the pool then forces one of the
    three out: it is prefilled again before the fourth (vLLM's order: preempted first)."""
    engine = make_engine("kv.cpu_pages=20", "engine.max_model_len=150", "engine.max_prefill_tokens=32",
                         "engine.max_batch_size=3")
    rng = random.Random(4)
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    first = [engine.add_request(rand_prompt(rng, 40), params) for _ in range(3)]
    prefills: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def record():
        plan = schedule()
        if plan.kind == "prefill":
            prefills.append([s.request_id for s in plan.seqs])
        return plan

    engine.scheduler.schedule = record
    while len(engine.scheduler.running) < 3:
        engine.step()
    late = engine.add_request(rand_prompt(rng, 10), params)
    victim = mark = None
    while engine.has_work:
        engine.step()
        preempted = [s.request_id for s in engine.scheduler.waiting if s.num_preemptions]
        if preempted and victim is None:
            victim, mark = preempted[0], len(prefills)
    assert victim in first, "the pool should have forced one of the first three out"
    after = [rid for step in prefills[mark:] for rid in step]
    assert after.index(victim) < after.index(late)


def test_two_rollouts_with_the_same_adapter_draw_different_samples():
    pytest.importorskip("trl")
    from flexgemma.rl.rollout import EngineRollout
    from flexgemma.rl.shared import SharedModel
    from flexgemma.rl.tokenizer import ids_to_text

    engine = build_engine(compose(["+model=tiny", "lora=r16", "device=cpu", "model.dtype=float32", "kv.page_size=8"]))
    shared = SharedModel(engine)
    prompt = [2, 40, 41, 42, 43]
    rollout = EngineRollout(engine, shared, {ids_to_text(prompt): prompt}.__getitem__, max_new_tokens=8)
    a = rollout([ids_to_text(prompt)] * 4, trainer=None)["completion_ids"]
    b = rollout([ids_to_text(prompt)] * 4, trainer=None)["completion_ids"]
    assert a != b and all(x != y for x, y in zip(a, b))


def test_the_is_correction_scales_advantages_by_exp_trainer_minus_engine(tmp_path, monkeypatch):
    """Engine logprobs perturbed by -0.3 on every token: the advantages TRL trains on are its own times
    exp(trainer - engine) ~ exp(0.3) token by token (clipped at is_clip_max), and no other factor."""
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from flexgemma.rl import rollout as rollout_mod
    from flexgemma.rl.rewards import TargetTokens
    from flexgemma.rl.tokenizer import ids_to_text

    engine = build_engine(compose(["+model=tiny", "lora=r16", "device=cpu", "model.dtype=float32", "kv.page_size=8"]))
    prompts = [[2, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(2)]
    data = Dataset.from_dict({"prompt": [ids_to_text(p) for p in prompts], "prompt_token_ids": prompts})
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, learning_rate=1e-2, report_to="none", use_cpu=True, save_strategy="no",
                      disable_tqdm=True, bf16=False, vllm_importance_sampling_clip_max=3.0)
    trainer, _, rollout = rollout_mod.grpo_trainer(engine, args, [TargetTokens(3, 259)], data)
    call = type(rollout).__call__

    def perturbed(self, prompts, trainer):
        out = call(self, prompts, trainer)
        return {**out, "logprobs": [[lp - 0.3 for lp in row] for row in out["logprobs"]]}

    seen = {}
    parent, real_stats = GRPOTrainer._generate_and_score_completions, rollout_mod.mismatch_stats

    def parent_spy(self, inputs):
        out = parent(self, inputs)
        seen["advantages"], seen["engine"] = out["advantages"].clone(), out["sampling_per_token_logps"].clone()
        return out

    def stats_spy(trainer_lp, *a, **k):
        seen["trainer"] = trainer_lp
        return real_stats(trainer_lp, *a, **k)

    monkeypatch.setattr(type(rollout), "__call__", perturbed)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", parent_spy)
    monkeypatch.setattr(rollout_mod, "mismatch_stats", stats_spy)
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    mask = out["completion_mask"].bool()
    ratio = torch.exp(seen["trainer"] - seen["engine"])
    want = ratio.clamp(max=3.0) * seen["advantages"].unsqueeze(1)
    torch.testing.assert_close(out["advantages"][mask], want[mask])
    assert torch.allclose(ratio[mask], torch.full_like(ratio[mask], math.exp(0.3)), rtol=1e-3)


# -- sweeps ------------------------------------------------------------------------------------------------
def test_a_sweep_relaunched_over_jobs_left_running_or_interrupted_runs_them_again(tmp_path):
    from conftest import run_python

    sweep = tmp_path / "sweep"
    args = ["-m", "flexgemma", "-m", "+model=tiny", "seed=0,1,2", "logger=none", "workload.num_prompts=2",
            "workload.max_new_tokens=2", "workload.rounds=1", "workload.warmup_rounds=0", f"hydra.sweep.dir={sweep}"]
    r = run_python(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for job, left in (("0", "running"), ("1", "interrupted")):
        summary = json.loads((sweep / job / "summary.json").read_text())
        (sweep / job / "summary.json").write_text(json.dumps({**summary, "status": left, "marker": True}))
    r = run_python(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        again = json.loads((sweep / job / "summary.json").read_text())
        assert again["status"] == "ok" and "marker" not in again, job  # ran again
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (\d+)\s+(\w+)\s", r.stdout, re.M)}
    assert rows == {"0": "ok", "1": "ok", "2": "skipped"}, r.stdout[-2000:]  # job 2 finished ok before


def test_every_mutation_of_the_mutation_check_matches_the_code():
    """experiments/mutation_check.py stops at a mutation whose text left the code: keep them in step."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("mutation_check", root / "experiments" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    counts = {m.name: (root / m.path).read_text().count(m.old) for m in mod.MUTATIONS}
    assert {name: n for name, n in counts.items() if n != 1} == {}
    assert len(counts) >= 20
