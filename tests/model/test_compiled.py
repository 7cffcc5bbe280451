"""model/compiled.py's CompileWatch: what compiled between start() and stop(), so a GRPO step (or any timed
work) can say its time includes compiling, and the steady state can leave such steps out."""

import pytest
import torch

from flexgemma.model.compiled import CompileWatch
from flexgemma.tasks.grpo import summarise


def test_a_new_shape_compiles_a_graph_and_a_seen_one_does_not():
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * 2, backend="eager", dynamic=False)
    watch = CompileWatch()
    f(torch.ones(3))
    assert watch.stop()["graphs"] == 1
    watch.start()
    f(torch.ones(3))
    assert watch.stop()["graphs"] == 0
    f(torch.ones(5))  # static shapes: another graph
    assert watch.stop()["graphs"] == 1


@pytest.mark.gpu
def test_triton_jit_compiles_are_counted_by_kernel_name():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    watch = CompileWatch()
    assert watch.triton
    x = torch.ones(8, device="cuda")
    double[(1,)](x, 8, BLOCK=8)
    double[(1,)](x, 8, BLOCK=8)
    double[(1,)](x, 8, BLOCK=16)  # another constexpr: another kernel
    got = watch.stop()
    assert got["kernels"] == 2 and got["kernel_names"] == {"double": 2}


def test_the_steady_state_leaves_out_the_steps_that_compiled():
    base = dict.fromkeys(["grpo/reward_mean", "grpo/refresh_ms", "grpo/rollout_tok_s", "grpo/logprob_absdiff_mean",
                          "grpo/logprob_absdiff_max", "grpo/kl_k3", "grpo/router_flip_rate", "grpo/is_ratio_max"], 0.0)
    rows = [{**base, "grpo/step_s": s, "grpo/train_s": s - 1, "grpo/rollout_s": 1.0, "grpo/compiled_graphs": g,
             "grpo/compiled_kernels": k} for s, g, k in [(100.0, 9, 30), (9.0, 0, 4), (5.0, 0, 0), (6.0, 0, 0)]]
    out = summarise(rows)
    assert out["grpo/compiling_steps"] == 2
    assert out["grpo/step_s_median_warm"] == 5.5 and out["grpo/train_s_median_warm"] == 4.5
    assert out["grpo/step_s_median"] == 7.5  # all four
