"""GPU checks (skipped without CUDA): E2B through the engine, parity with transformers in float32,
and CUDA graphs vs no graphs."""

import pytest
import torch

from flexgemma import SamplingParams, build_engine, compose
from flexgemma.tasks.parity import first_divergence, float32_divergence, hf_greedy

from conftest import outputs_per_setting

pytestmark = pytest.mark.gpu


def prompts(vocab, lengths=(7, 130, 600), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def engine_for(*overrides):
    return build_engine(compose(["device=cuda", "kv.max_pages=128", "engine.max_model_len=1024",
                                 "engine.max_batch_size=8", *overrides]))


@pytest.mark.parametrize("dtype, backend", [("bfloat16", "flex"), ("float32", "flex"), ("float32", "dense")])
def test_e2b_eager_generates_and_fp32_matches_transformers(dtype, backend):
    """float32: the same greedy tokens as transformers, except where float64 says the two choices are
    as close as float32 rounding makes them.

    Random weights give a near-flat distribution over 262k tokens, and 35 random layers amplify
    rounding: on E2B's geometry transformers' own float32 logprobs sit ~1e-2 from float64's at 600
    tokens (experiments/float32_error.py). At a divergence, transformers in float64 on the
    same weights judges: its preference for transformers' token over ours, and our logprob's error
    against it, must be within max(2e-3, 4 x flexgemma's own packed-vs-alone noise, 3 x transformers'
    float32 error there). A real difference (a wrong window, a wrong page) stands far above it."""
    import copy

    # backend=dense (mask_mod + SDPA, the CPU path) beside flex tells a flex kernel problem from the rest
    engine = engine_for("+model=e2b", f"model.dtype={dtype}", "cudagraph=off", "engine.compile=false",
                        f"attn.backend={backend}")
    ps = prompts(engine.spec.vocab_size)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = engine.generate(ps, sp)
    assert all(len(o.token_ids) == 16 for o in outs)
    if dtype == "float32":
        noise = 0.0
        for p, o in zip(ps, outs):
            a = engine.generate([p], sp)[0]
            d = first_divergence(a.token_ids, o.token_ids)
            common = len(o.token_ids) if d is None else d  # logprobs of the same tokens
            gaps = [abs(x - y) for x, y in zip(a.logprobs[:common], o.logprobs[:common])]
            noise = max([noise, *gaps])
            print(f"prompt {len(p)}: alone vs packed part at {d}, max |logprob| gap before {max(gaps, default=0):.2e}")
        model64 = None
        for p, o in zip(ps, outs):
            ref = hf_greedy(engine.model, p, 16)
            d = first_divergence(o.token_ids, ref)
            if d is None:
                continue
            if model64 is None:  # float64 transformers, built at the first divergence only
                model64 = copy.deepcopy(engine.model).double()
            r = float32_divergence(engine.model, model64, p + ref[:d], o.token_ids[d], o.logprobs[d], ref[d])
            tol = max(2e-3, 4 * noise, 3 * r["hf_error"])
            print(f"prompt {len(p)}: first divergence from transformers at {d}: {r}, tolerance {tol:.2e}")
            assert r["margin64"] < tol and r["our_error"] < tol, (len(p), d, r, tol)
    del engine
    torch.cuda.empty_cache()


@pytest.mark.parametrize("model, dtype, compile_glue", [
    ("tiny", "bfloat16", "true"), ("tiny", "float32", "false"), ("tiny_moe", "bfloat16", "false"),
])
def test_graphs_equal_no_graphs(model, dtype, compile_glue):
    engine = engine_for(f"+model={model}", f"model.dtype={dtype}", "cudagraph.buckets=[1,2,4,8]",
                        f"engine.compile={compile_glue}")
    assert engine.runner.graphs is not None
    ps = prompts(engine.spec.vocab_size, lengths=(3, 20, 45, 70, 9))
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with_graphs = [o.token_ids for o in engine.generate(ps, sp)]
    assert sum(engine.runner.graphs.hits.values()) > 0
    graphs, engine.runner.graphs = engine.runner.graphs, None
    engine.reset_prefix_cache()  # compute the prompts again, as the first call did
    without = [o.token_ids for o in engine.generate(ps, sp)]
    engine.runner.graphs = graphs
    assert with_graphs == without
    if dtype == "float32":
        for p, o in zip(ps, with_graphs):
            assert o == hf_greedy(engine.model, p, 40)


def test_prefill_full_blocks_change_nothing_but_speed():
    """kernels.prefill_full_blocks through compiled flex, float32, E2B's window geometry on the tiny
    model (a 512-token window, prompts of 7, 130 and 600 tokens packed: full blocks on both layer
    types): the same greedy tokens and logprobs (to float32 rounding) as every page partial."""
    def build(*extra):
        return engine_for("+model=tiny", "model.dtype=float32", "model.hf_config.sliding_window=512",
                          "model.hf_config.max_position_embeddings=2048", "cudagraph=off", *extra)

    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    runs = outputs_per_setting(build, "kernels.prefill_full_blocks", (False, True), prompts(512), sp)
    for plain, fast in zip(*runs):
        assert plain.token_ids == fast.token_ids
        assert max(abs(a - b) for a, b in zip(plain.logprobs, fast.logprobs)) < 1e-4


def test_fused_kv_write_in_graphs_equals_the_norms_then_the_write():
    """kernels.fused_kv_write (the K/V norms and the pool write as one compiled function) captured in
    the decode graphs, float32 tiny: the same greedy tokens as the default, and the pools are not
    copied: the graphs' memory pool, and a second generate's peak over what was allocated before it,
    within a pool's size of the default's (absolute peaks also count what was allocated before the
    generate began: 256 MiB more for the second engine on the H200)."""
    runs, peaks, graph_pools = [], [], []
    for fused in (False, True):
        engine = engine_for("+model=tiny", "model.dtype=float32", "cudagraph.buckets=[1,2,4,8]",
                            f"kernels.fused_kv_write={fused}")
        graph_pools.append(engine.runner.graphs.pool_bytes)
        ps = prompts(engine.spec.vocab_size, lengths=(3, 20, 45, 70, 9))
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        first = [o.token_ids for o in engine.generate(ps, params)]
        engine.reset_prefix_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runs.append([o.token_ids for o in engine.generate(ps, params)])
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert runs[-1] == first
        pool = max(k.numel() * k.element_size() for k, _ in
                   (engine.runner.cache.layer_kv(s.index) for s in engine.spec.kv_layers))
        del engine
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
    assert peaks[1] <= peaks[0] + pool, (peaks, pool)
    assert graph_pools[1] <= graph_pools[0] + pool, (graph_pools, pool)


def test_async_decode_with_graphs_equals_sync():
    engine = engine_for("+model=tiny", "cudagraph.buckets=[1,2,4,8]")
    ps = prompts(engine.spec.vocab_size, lengths=(3, 20, 45, 70, 9))
    params = [SamplingParams(max_new_tokens=40, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 0.0, 0.8, 0.0))]
    engine.async_decode = False
    sync = [(o.token_ids, o.finish_reason) for o in engine.generate(ps, params)]
    engine.async_decode = True
    engine.reset_prefix_cache()  # compute the prompts again, as the first call did
    asyn = [(o.token_ids, o.finish_reason) for o in engine.generate(ps, params)]
    assert asyn == sync and engine.stats.chained_steps > 0
    from flexgemma.tasks.common import gpu_decode_metrics

    m = gpu_decode_metrics(engine.stats)  # CUDA events around every decode step
    assert engine.stats.gpu_decode_steps == engine.stats.decode_steps
    assert m["latency/decode_gpu_step_ms"] > 0 and 0 <= m["scheduler/gpu_idle_pct"] < 100, m
    print("async decode on the GPU:", m)


def test_handing_out_pages_does_not_wait_for_the_step_in_flight():
    """With async decode the scheduler grows the batch while the previous step runs; recording a
    new page's position must not wait for the GPU (a pageable copy did, at almost every decode
    step: 2.3 ms of idle GPU a step at E2B batch 256). The positions reach the device with the next
    step's inputs."""
    from flexgemma.engine.sequence import Sequence

    engine = engine_for("+model=tiny", "cudagraph=off")
    sched, group = engine.scheduler, engine.scheduler.cache.page_groups[0]
    seq = Sequence(10_000, 0, list(range(3, 40)), SamplingParams(max_new_tokens=4), seed=0)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the step in flight: the GPU busy for about a second
    assert sched.grow(seq, 37)
    still_busy = not torch.cuda.current_stream().query()
    pages = list(group.pages_of(seq))
    engine.scheduler.cache.upload_positions()
    torch.cuda.synchronize()
    assert still_busy, "growing a sequence waited for the GPU"
    assert group.pos[pages].tolist() == [i * engine.scheduler.page_size for i in range(len(pages))]
    sched._release_all(seq)
