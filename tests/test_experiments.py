"""The GPU benchmark script runs end to end on the CPU (a smoke test: device time is scarce, a
script that crashes there wastes it)."""

import json
import os
import subprocess
import sys

from conftest import ROOT  # noqa: E402 - the repository


def test_bench_vs_hf_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_vs_hf.py"), "+model=tiny", "workload.num_prompts=3",
         "workload.max_new_tokens=6", "workload.rounds=1", "workload.warmup_rounds=0", "logger=none",
         "--hf-rounds", "1", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["flexgemma/tok_s_median"] > 0 and res["hf/tok_s_median"] > 0
    assert res["hf/generated_tokens"] == 3 * 6
    assert res["roofline/weight_gb_per_step"] > 0


def test_bench_vs_hf_batch_sizes_and_parity_moe(tmp_path):
    """One build timed at several batch sizes, transformers at one of them, and greedy parity (exact in
    float32 on the CPU, so a broken parity path fails here)."""
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_vs_hf.py"), "+model=tiny_moe", "workload.num_prompts=4",
         "workload.max_new_tokens=5", "workload.rounds=1", "workload.warmup_rounds=0", "logger=none",
         "--batch-sizes", "2,4", "--both-loops", "--hf-batch-sizes", "2", "--hf-rounds", "1", "--parity", "2",
         "--parity-tokens", "6", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["batch_sizes"] == [2, 4]
    assert res["bs2/flexgemma/tok_s_median"] > 0 and res["bs4/flexgemma/tok_s_median"] > 0
    assert res["bs4/sync/flexgemma/tok_s_median"] > 0  # --both-loops: the same build, the other decode loop
    assert res["bs2/hf/generated_tokens"] == 2 * 5 and "bs4/hf/tok_s_median" not in res
    # MoE roofline: 4 rows route to more experts than 2
    assert res["bs4/roofline/weight_gb_per_step"] > res["bs2/roofline/weight_gb_per_step"]
    assert res["parity/token_match_pct"] == 100.0 and res["parity/teacher_forced_top1_pct"] == 100.0
    assert res["parity/first_divergence_per_prompt"] == [-1, -1]


def test_batch_too_large_for_workload_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_vs_hf.py"), "+model=tiny", "workload.num_prompts=2",
         "logger=none", "--batch-sizes", "2,8", "--no-hf"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode != 0 and "workload.num_prompts=8" in r.stderr


def test_gpu_suite_lists_its_stages_in_order_and_parses():
    """experiments/gpu_suite.sh: the header's stage list is every `run NAME` in file order (stages run in
    file order whatever the command line says, so a call's plan is read from the header), and bash
    parses the script."""
    import re

    text = (ROOT / "experiments" / "gpu_suite.sh").read_text()
    header = re.search(r"^# Stages \(in this order\): (.*)$", text, re.M).group(1).split()
    assert header == re.findall(r"^run (\w+) ", text, re.M)
    assert subprocess.run(["bash", "-n", str(ROOT / "experiments" / "gpu_suite.sh")]).returncode == 0


def test_decode_sweep_overrides_give_the_engine_the_options_it_timed():
    """profile_decode's best flex decode options become Hydra overrides; composed, they are the options
    the engine's attention layers use (a wrong group or field name fails here, not on the GPU)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from profile_decode import decode_overrides

    from flexgemma import compose
    from flexgemma.model.attention import kernel_options

    full = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}
    sweep = [
        {"layer_type": "sliding_attention", "head_dim": 256, "options": {"BLOCK_N": 32}, "ms": 1.0,
         "engine_default": True},
        {"layer_type": "sliding_attention", "head_dim": 256, "options": {"BLOCK_N": 64, "num_warps": 8,
                                                                         "num_stages": 3}, "ms": 0.9},
        {"layer_type": "full_attention", "head_dim": 512, "options": {"BLOCK_N": 16}, "ms": 1.0,
         "engine_default": True},
        {"layer_type": "full_attention", "head_dim": 512, "options": full, "ms": 0.7},
        {"layer_type": "full_attention", "head_dim": 512, "options": {"BLOCK_N": 64}, "error": "OutOfResources"},
    ]
    ov = decode_overrides(sweep)
    cfg = compose(["+model=tiny", *ov])
    assert kernel_options(cfg.attn.decode, 256, 64) == {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert kernel_options(cfg.attn.decode, 512, 64) == full
    # under a 2% gain the engine keeps its own options
    sweep[1]["ms"] = 0.99
    assert not any(o.startswith("attn.decode.block_n") for o in decode_overrides(sweep))


def test_prefill_page_checks_time_both_masks_and_compare_their_bits(monkeypatch):
    """profile_decode --prefill-page-checks on the CPU (flex eager, a wall-clock timer): a row per layer type
    and check, the owner masks' mask_mod where no page is shared, the same bits from both."""
    import time

    import torch

    sys.path.insert(0, str(ROOT / "experiments"))
    import profile_decode

    from flexgemma import build_engine, compose

    def wall_ms(fn, iters=10):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(profile_decode, "cuda_time_ms", wall_ms)
    cfg = compose(["+model=tiny", "device=cpu", "workload=rollout64", "workload.num_prompts=6", "kv.page_size=16",
                   "workload.min_prompt_len=20", "workload.max_prompt_len=90", "engine.max_prefill_tokens=256"])
    rows = profile_decode.time_page_checks(build_engine(cfg), cfg)
    assert {(r["page_check"], r["layer_type"]) for r in rows} == \
        {(c, t) for c in ("table", "owner") for t in ("sliding_attention", "full_attention")}
    assert {r["mask_check"] for r in rows if r["page_check"] == "owner"} == {"owner"}
    assert all(r["bits_equal"] for r in rows)


def test_float32_error_smoke(tmp_path):
    """experiments/float32_error.py on the tiny model: a table row per prompt, flexgemma's float32 as
    close to float64 as rounding allows on a model this small."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "float32_error.py"), "+model=tiny", "--lengths", "7,40"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| 7 ") or line.startswith("| 40 ")]
    assert len(rows) == 2 and all(float(row[1]) < 1e-4 for row in rows), r.stdout


def test_bench_4bit_forms_check_on_the_cpu():
    """experiments/bench_4bit_forms.py --check (Triton's interpreter): its CUDA-core and swapped-operand forms of
    the 4-bit gate_up projection equal the production kernel's up to summation order, a row alone equals the
    same row in the step, and the bytes-only kernel runs: the GPU call then only times them."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_4bit_forms.py"), "--device", "cpu", "--check", "--dtype",
         "float16", "--hidden", "128", "--intermediate", "64", "--experts", "6", "--top-k", "2", "--batch-sizes", "5,40"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    checks = [ln for ln in r.stdout.splitlines() if ln.startswith("batch ")]
    assert len(checks) == 2, r.stdout
    for ln in checks:
        for part in ln.split(": ", 1)[1].split("; "):
            diff, alone = part.split(" max diff ")[1].split(" row alone equal ")
            assert float(diff) < 1e-3 and alone == "True", ln
    # --ablate: the production kernel with one part swapped at a time; those that keep the products give its bits
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_4bit_forms.py"), "--device", "cpu", "--check", "--ablate",
         "--dtype", "float16", "--hidden", "128", "--intermediate", "64", "--experts", "6", "--top-k", "2",
         "--batch-sizes", "5"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("ablate batch 5: "))
    assert line.count("(bits True)") == 4 and "False" not in line and line.count(" us") == 9, line


def test_bench_invariant_linear_times_every_dense_product_of_a_decode_step():
    """bench_invariant_linear's shapes (the engine's fused q/k/v, o, gate/up, down, per-layer-input and router
    products) hold exactly the weights of the decoder layers' nn.Linear modules of transformers' model, built
    on the meta device: a shape missed or fused wrongly changes the sum."""
    import torch
    from transformers import Gemma4ForCausalLM

    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_invariant_linear import projection_shapes

    from flexgemma import compose
    from flexgemma.model.estimate import _text_config

    for model in ("e2b", "26b_a4b", "31b"):
        config = _text_config(compose([f"+model={model}"]).model)
        with torch.device("meta"):
            layers = Gemma4ForCausalLM(config).model.layers
        want = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
        assert sum(n * k * count for (n, k), count in projection_shapes(model).items()) == want, model
