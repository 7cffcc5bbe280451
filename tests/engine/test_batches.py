"""RL-sized batches (issue 21): the auto graph ladder, the warm-up, the first-round check, the
decode-attention row counts, KV bytes per token and the round profiler (tiny, on the CPU)."""

import dataclasses
import importlib.util
import json
import random

import pytest
import torch

from flexgemma import SamplingParams, compose
from flexgemma.config.schema import validate_kernels
from flexgemma.engine.cuda_graphs import auto_buckets, resolve_buckets
from flexgemma.config.kernels import attention_row_sizes
from flexgemma.engine.warm import RoundWatch, warm_up
from flexgemma.model.attention import kernel_options
from flexgemma.model.spec import FULL
from flexgemma.tasks.bench import first_round_check

from conftest import make_engine

from conftest import ROOT  # noqa: E402 - the repository


@pytest.mark.parametrize("max_batch, ladder", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
    (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]),
    (256, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]),
    (512, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]),
    (1000, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1000]),
])
def test_auto_ladder_follows_max_batch_size(max_batch, ladder):
    assert auto_buckets(max_batch) == ladder


def test_auto_ladder_pads_at_most_a_third_from_17_rows():
    ladder = auto_buckets(512)
    for n in range(17, 513):
        b = next(x for x in ladder if x >= n)
        assert (b - n) / b <= 1 / 3, (n, b)


def test_auto_is_the_default_and_presets_keep_their_ladders():
    cfg = compose(["engine.max_batch_size=512"])
    assert cfg.cudagraph.name == "auto" and cfg.cudagraph.buckets is None
    assert resolve_buckets(cfg.cudagraph.buckets, 512)[-1] == 512
    assert list(compose(["cudagraph=ladder8"]).cudagraph.buckets) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert list(compose(["cudagraph=ladder16"]).cudagraph.buckets) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert len(compose(["cudagraph=dense"]).cudagraph.buckets) == 64
    assert not compose(["cudagraph=off", "engine.max_batch_size=300"]).cudagraph.enabled
    assert resolve_buckets([1, 4], 4) == [1, 4]  # a given list is kept as it is


@pytest.mark.parametrize("model, batch, new", [("e2b", 256, 512), ("e4b", 128, 512), ("26b_a4b", 128, 256),
                                               ("31b", 64, 256)])
def test_rl_batch_presets(model, batch, new):
    cfg = compose([f"+model={model}", f"+experiment=rl_batch_{model}"])
    w = cfg.workload
    assert (w.num_prompts, cfg.engine.max_batch_size, w.max_new_tokens) == (batch, batch, new)
    assert (w.min_prompt_len, w.max_prompt_len, w.ignore_eos, w.rounds) == (64, 512, True, 3)
    assert cfg.cudagraph.name == "auto" and cfg.engine.max_model_len >= 512 + new


def test_attention_row_sizes():
    assert attention_row_sizes(512) == [32, 128, 512]
    assert attention_row_sizes(64) == [16, 64]
    assert attention_row_sizes(8) == [8]
    assert attention_row_sizes(200) == [50, 200]


def test_decode_attention_padded_to_a_row_count_gives_the_same_tokens():
    """Decode attention padded past the batch (what the flex kernels do, at a few row counts) changes
    no token or logprob: padding rows see only the sink slot and are cut off."""
    prompts = [[2] + [5 + (7 * i + j) % 90 for j in range(10 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    plain = make_engine("engine.max_batch_size=8")
    want = plain.generate(prompts, params)
    padded = make_engine("engine.max_batch_size=8")
    # batches of 1-3 run attention at 3 rows, 4-8 at 8 (the rows flex is compiled at; the CPU's dense
    # attention takes any count, so the test hands both readers of the row counts new ones)
    kernels = dataclasses.replace(padded.runner.kernels, decode_rows=(3, 8))
    padded.runner.kernels = padded.runner.forward.attention.kernels = kernels
    assert kernels.padded_rows(2) == 3 and kernels.padded_rows(5) == 8
    got = padded.generate(prompts, params)  # 5 rows (padded to 8), then fewer as none finish early: all 5
    got3 = padded.generate(prompts[:2], params)  # 2 rows padded to 3
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # not bitwise: on more than one thread the padded rows change how the matmuls split their sums (a few ulps)
    eps = torch.finfo(plain.model.dtype).eps
    torch.testing.assert_close([o.logprobs for o in got], [o.logprobs for o in want], rtol=16 * eps, atol=16 * eps)
    assert [o.token_ids for o in got3] == [o.token_ids for o in want[:2]]
    with pytest.raises(ValueError, match="at most 8"):
        kernels.padded_rows(9)


def test_warm_up_leaves_no_trace():
    """The build-time warm-up runs generate() but leaves the request ids, counters and pages as they
    were: the next requests draw the same default seeds and give the same tokens as without it."""
    prompts = [[2, 17, 33, 41], [2, 8, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)  # no seed: the request id picks it
    cold = make_engine()
    want = [o.token_ids for o in cold.generate(prompts, params)]
    warm = make_engine()
    info = warm_up(warm, max_prefill_tokens=64)
    assert info["warmup_seconds"] > 0 and info["compiled_graphs"] >= 0
    assert warm.stats.decode_steps == 0 and not warm.has_work
    assert all(g.in_use == 0 for g in warm.runner.cache.page_groups)  # no page left behind
    assert [o.token_ids for o in warm.generate(prompts, params)] == want


def test_round_watch_counts_compiles_inside_a_round():
    engine = make_engine()
    watch = RoundWatch(engine)
    watch.start()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    got = watch.stop()
    assert got["bench/compiled_in_round"] >= 1
    watch.start()
    assert watch.stop()["bench/compiled_in_round"] == 0


def test_first_round_check():
    assert first_round_check([10.0, 10.2, 9.9])["bench/first_round_within_5pct"]
    slow = first_round_check([18.0, 10.0, 10.1, 9.9])
    assert not slow["bench/first_round_within_5pct"] and slow["bench/first_round_ratio"] == pytest.approx(10.05 / 18)


def test_kv_bytes_per_token_in_the_build_info():
    """E2B: 15 KV-writing layers (20 share), sliding ones 1 KV head x 256 and full ones 1 x 512;
    a sliding layer holds at most its window (512)."""
    from flexgemma.model.load import text_config_from_dict
    from flexgemma.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(text_config_from_dict(dict(compose(["+model=e2b"]).model.hf_config)))
    writers = spec.kv_layers
    full = [s for s in writers if s.layer_type == FULL]
    per_token = sum(2 * s.num_kv_heads * s.head_dim * 2 for s in writers)
    assert spec.kv_bytes_per_token(2) == per_token
    assert spec.kv_bytes_per_sequence(100, 2) == 100 * per_token
    full_bytes = sum(2 * s.num_kv_heads * s.head_dim * 2 for s in full)
    assert spec.kv_bytes_per_sequence(2000, 2) == 2000 * full_bytes + 512 * (per_token - full_bytes)
    info = make_engine().info
    assert info["kv_bytes_per_token"] > info["kv_bytes_per_token_full_layers"] > 0
    assert "graph_pool_gib" in info and "cudagraph_buckets" in info


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_generate_times_a_round_on_the_cpu(tmp_path):
    """experiments/profile_generate.py end to end (tiny, CPU: host timers only, no CUDA events)."""
    out = tmp_path / "profile.json"
    res = load_script("profile_generate").main([
        "--model", "tiny", "--device", "cpu", "--batch", "3", "--new-tokens", "4", "--out", str(out), "--profile-prefill",
        "workload.min_prompt_len=4", "workload.max_prompt_len=12", "kv.page_size=8", "kernels.prefill_full_blocks=false"])
    assert res["decode_steps"] >= 3 and res["tok_s"] > 0 and "gpu_step_ms_median" not in res
    assert res["overrides"][-1] == "kernels.prefill_full_blocks=false"  # an A/B of a kernel choice: an override
    assert res["prefill_kernels"]["kernels"] and res["prefill_kernels"]["wall_ms"] > 0
    for name in ("grow pages", "fill inputs + masks", "postprocess", "wait + read tokens", "synchronous steps (prefill)"):
        assert res["calls"][name] > 0, name
    assert json.loads(out.read_text())["batch"] == 3


def test_one_rounds_loop_for_the_bench_task_and_the_scripts():
    """tasks.common.timed_rounds: warm-up rounds, then the hook between them and the timed ones, then
    each timed round (outputs, step counters, what compiled) handed to on_round as it ends; task=bench
    logs its metrics from that hook, the scripts read the returned rounds."""
    from flexgemma.tasks.common import timed_rounds

    engine = make_engine()
    prompts = [[2, 17, 33, 41], [2, 8, 9]]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    events = []
    rounds = timed_rounds(engine, prompts, params, rounds=2, warmup=1, before_timed=lambda: events.append("timed"),
                          on_round=lambda r, t: events.append((r, t.tokens, t.compiled)))
    assert events == ["timed", (0, 10, 0), (1, 10, 0)]
    assert len(rounds) == 2 and rounds[0].token_ids == rounds[1].token_ids and rounds[0].tok_s > 0
    assert rounds[1].stats.decode_steps == 4 and rounds[1].stats.prefill_tokens == 7 and rounds[1].stats is not rounds[0].stats


def test_after_the_warm_up_rounds_of_other_sizes_compile_nothing():
    """engine.warmup with the compiled glue and sampler (on the CPU here; the GPU's decode graphs are
    captured at build anyway): rounds of one row, a few rows, all-greedy or sampled rows after a
    warm-up shaped for the largest batch build no graph inside the round (issue 21: a greedy batch-64
    round compiled the sampler's greedy-only variant; a one-row round compiled 11 graphs)."""
    engine = make_engine("engine.compile=true", "engine.warmup=true", "engine.max_batch_size=6",
                         "engine.max_prefill_tokens=256", "kv.cpu_pages=200")
    assert engine.info["warmup_compiled_graphs"] > 0
    watch, rng = RoundWatch(engine), random.Random(0)
    for bs, temperature in ((6, 0.0), (1, 0.0), (3, 1.0), (1, 1.0), (2, 0.0)):
        prompts = [[2] + [rng.randrange(3, 500) for _ in range(rng.randrange(20, 120))] for _ in range(bs)]
        watch.start()
        engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=temperature, seed=1, ignore_eos=True))
        assert watch.stop()["bench/compiled_in_round"] == 0, (bs, temperature)


def test_bench_sampler_runs_on_the_cpu(tmp_path):
    """experiments/bench_sampler.py end to end (eager, small vocabulary): both ways agree."""
    rows = load_script("bench_sampler").main(["--device", "cpu", "--eager", "--rows", "2,3", "--vocab", "1024",
                                              "--out", str(tmp_path / "s.json")])
    assert len(rows) == 4 and all(r["tokens_equal"] and r["logprob_max_diff"] == 0.0 for r in rows)
    assert all(r["cap_inside_us"] > 0 and r["cap_apart_us"] > 0 for r in rows)


@pytest.mark.parametrize("model, sliding_stages, full_tile", [
    ("e2b", 2, (32, 3)), ("e4b", 3, (32, 3)), ("26b_a4b", 2, (32, 3)), ("31b", 2, (16, 2))])
def test_rl_batch_presets_carry_their_measured_decode_tiles(model, sliding_stages, full_tile):
    """Each preset's flex decode tiles are the ones its H200 round measured faster with (RESULTS.md, RL-
    sized batches): BLOCK_N 64 / 4 warps on the sliding layers (head_dim 256), and BLOCK_N 32 / 3 stages
    on the full-attention ones (head_dim 512) where that was measured (31B keeps the engine's)."""
    cfg = compose([f"+model={model}", f"+experiment=rl_batch_{model}"])
    validate_kernels(cfg)  # the tiles divide the preset's page size (compose checked the rest)
    page = cfg.kv.page_size
    assert kernel_options(cfg.attn.decode, 256, page) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": sliding_stages}
    block_n, stages = full_tile
    assert kernel_options(cfg.attn.decode, 512, page) == {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": 4,
                                                          "num_stages": stages}
    assert cfg.kernels.fused_kv_write == (model == "31b")
