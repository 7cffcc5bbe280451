"""engine.moe_kernel=triton: the decode-sized expert GEMM in Triton. On the CPU it runs through
Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be set before Triton
loads), in float16 (the interpreter mishandles bfloat16); on the GPU in bfloat16 inside graphs."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flexgemma import ConfigError, SamplingParams, build_engine, compose

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton", reason="Triton is not installed (CUDA builds of torch bring it)")


def run_interpreted(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_expert_rows_mm_equals_the_segment_reference_interpreted():
    out = run_interpreted("""
        import torch
        from flexgemma.model.moe import _segment_mm
        from flexgemma.model.moe_kernel import expert_rows_mm
        torch.manual_seed(0)
        # empty experts, an expert with more rows than one 16-row tile, N and K not multiples of the tiles
        for r, n, k, counts in [(11, 40, 70, [2, 0, 5, 0, 4]), (40, 64, 128, [0, 37, 3])]:
            x = torch.randn(r, k).half()
            w = (torch.randn(len(counts), n, k) * 0.1).half()
            ends = torch.tensor(counts).cumsum(0).to(torch.int32)
            got = expert_rows_mm(x, w, ends, block_n=32, block_k=32).float()
            ref = _segment_mm(x.float(), w.float().transpose(1, 2), ends)
            print(float((got - ref).abs().max() / ref.abs().max()))
    """)
    errs = [float(v) for v in out.split()]
    assert len(errs) == 2 and max(errs) < 2e-3, errs


def test_triton_experts_path_equals_loop_and_engine_wiring_interpreted():
    """experts_grouped with the Triton GEMM equals the per-expert loop (float16), and an engine built
    with engine.moe_kernel=triton hands that GEMM to its MoE layers."""
    out = run_interpreted("""
        import torch
        from flexgemma import build_engine, compose
        from flexgemma.model.moe import experts_grouped, experts_loop
        from flexgemma.model.moe_kernel import TritonExperts
        torch.manual_seed(0)
        e, h, i, k = 8, 64, 32, 2
        gate_up, down = (torch.randn(e, 2 * i, h) * 0.1).half(), (torch.randn(e, h, i) * 0.1).half()
        act = torch.nn.functional.gelu
        for t in (1, 5):
            x = torch.randn(t, h).half()
            w, idx = torch.softmax(torch.randn(t, e), -1).topk(k, dim=-1)
            got = experts_grouped(x, idx, w, gate_up, down, act, kernel=TritonExperts()).float()
            ref = experts_loop(x.float(), idx, w, gate_up.float(), down.float(), act).float()
            print("err", float((got - ref).norm() / ref.norm()))
        engine = build_engine(compose(["+model=tiny_moe", "device=cpu", "engine.moe_kernel=triton"]))
        print("wired", isinstance(engine.runner.forward.ops.experts_kernel, TritonExperts), engine.info["moe_kernel"])
    """)
    errs = [float(line.split()[1]) for line in out.splitlines() if line.startswith("err")]
    assert len(errs) == 2 and max(errs) < 5e-3, out
    assert "wired True triton" in out, out


def test_packed_4bit_experts_decoded_in_the_kernel_interpreted():
    """4-bit experts (NF4 and FP4, with and without double quantisation) decoded tile by tile inside
    the kernel equal bitsandbytes' own dequantisation followed by the plain product, for all experts
    and for a routed subset (padding slots included), and through experts_grouped."""
    out = run_interpreted("""
        import torch
        from flexgemma.model.moe import _segment_mm, experts_grouped, experts_loop
        from flexgemma.model.moe_kernel import TritonExperts, expert_rows_mm_4bit
        from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        w = torch.randn(5, 48, 128) * 0.1
        for qt in ("nf4", "fp4"):
            for dq in (False, True):
                pw = PackedExpertWeight.pack(w.half(), Bnb4Settings(quant_type=qt, double_quant=dq,
                                                                   compute_dtype=torch.float16), cpu)
                for ids, counts in ((None, [2, 0, 5, 0, 4]), (torch.tensor([3, 0, 4, 1]), [3, 2, 0, 0])):
                    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
                    x = torch.randn(sum(counts), 128).half()
                    ref = _segment_mm(x.float(), pw.dequantize(ids).float().transpose(1, 2), ends)
                    got = expert_rows_mm_4bit(x, pw, ids, ends, block_n=32, block_k=32).float()
                    print("err", float((got - ref).abs().max() / ref.abs().max()))
        s = Bnb4Settings(double_quant=True, compute_dtype=torch.float16)
        gate_up = PackedExpertWeight.pack((torch.randn(8, 64, 64) * 0.1).half(), s, cpu)
        down = PackedExpertWeight.pack((torch.randn(8, 64, 32) * 0.1).half(), s, cpu)
        act = torch.nn.functional.gelu
        for t in (1, 3):  # 2 and 6 rows: fewer than the 8 experts, so a routed subset with padding slots
            x = torch.randn(t, 64).half()
            wts, idx = torch.softmax(torch.randn(t, 8), -1).topk(2, dim=-1)
            got = experts_grouped(x, idx, wts, gate_up, down, act, kernel=TritonExperts()).float()
            ref = experts_loop(x.float(), idx, wts, gate_up.dequantize().float(), down.dequantize().float(), act)
            print("err", float((got - ref).norm() / ref.norm()))
    """)
    errs = [float(line.split()[1]) for line in out.splitlines() if line.startswith("err")]
    assert len(errs) == 10 and max(errs) < 5e-3, out


def test_triton_kernel_on_the_cpu_without_the_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    with pytest.raises(ConfigError, match="engine.moe_kernel=triton runs on a GPU"):
        build_engine(compose(["+model=tiny_moe", "device=cpu", "engine.moe_kernel=triton"]))
    with pytest.raises(ConfigError, match="grouped_mm or triton"):
        compose(["+model=tiny_moe", "engine.moe_kernel=cutlass"])


@pytest.mark.gpu
def test_gpu_triton_experts_equal_loop_and_run_in_graphs():
    from flexgemma.model.moe import experts_grouped, experts_loop
    from flexgemma.model.moe_kernel import TritonExperts

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, h, i, k = 16, 256, 128, 4
    gate_up = (torch.randn(e, 2 * i, h, device=dev) * 0.05).bfloat16()
    down = (torch.randn(e, h, i, device=dev) * 0.05).bfloat16()
    act = torch.nn.functional.gelu
    for t in (1, 8, 64):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w, idx = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, dim=-1)
        got = experts_grouped(x, idx, w, gate_up, down, act, kernel=TritonExperts()).float()
        ref = experts_loop(x.float(), idx, w, gate_up.float(), down.float(), act).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[2, 5, 9, 14, 3], [2, 77, 31], [2, 8, 8, 8]]
    toks = {}
    for kernel in ("grouped_mm", "triton"):
        engine = build_engine(compose(["+model=tiny_moe", "device=cuda", "kv.max_pages=64", "engine.max_batch_size=8",
                                       "cudagraph.buckets=[1,2,4,8]", f"engine.moe_kernel={kernel}"]))
        toks[kernel] = [o.token_ids for o in engine.generate(prompts, sp)]
        assert sum(engine.runner.graphs.hits.values()) > 0
    agree = sum(a == b for x, y in zip(toks["grouped_mm"], toks["triton"]) for a, b in zip(x, y))
    assert agree >= 0.9 * 24 * len(prompts)  # bf16: summation order may flip a near tie late in a sequence


@pytest.mark.gpu
def test_gpu_triton_4bit_experts_equal_dequantised_and_shrink_the_graph_pool():
    from flexgemma.model.moe import experts_grouped, experts_loop
    from flexgemma.model.moe_kernel import TritonExperts
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    torch.manual_seed(0)
    dev = torch.device("cuda")
    s = Bnb4Settings(double_quant=True)
    gate_up = PackedExpertWeight.pack((torch.randn(16, 256, 256) * 0.05).bfloat16(), s, dev)
    down = PackedExpertWeight.pack((torch.randn(16, 256, 128) * 0.05).bfloat16(), s, dev)
    act = torch.nn.functional.gelu
    for t in (1, 3, 64):
        x = torch.randn(t, 256, device=dev, dtype=torch.bfloat16)
        w, idx = torch.softmax(torch.randn(t, 16, device=dev), -1).topk(4, dim=-1)
        got = experts_grouped(x, idx, w, gate_up, down, act, kernel=TritonExperts()).float()
        ref = experts_loop(x.float(), idx, w, gate_up.dequantize().float(), down.dequantize().float(), act)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    pools = {}
    for kernel in ("grouped_mm", "triton"):
        engine = build_engine(compose(["+model=tiny_moe", "quant=bnb4", "device=cuda", "kv.max_pages=64",
                                       "engine.max_batch_size=8", "cudagraph.buckets=[1,2,4,8]",
                                       f"engine.moe_kernel={kernel}"]))
        outs = engine.generate([[2, 5, 9, 14, 3]] * 3, SamplingParams(max_new_tokens=8, temperature=0.0))
        assert all(len(o.token_ids) == 8 for o in outs)
        pools[kernel] = engine.runner.graphs.pool_bytes
    print(pools)
    assert pools["triton"] <= pools["grouped_mm"]
