"""GPU checks of the engine (skipped without CUDA): CUDA graphs against no graphs, prefill masks'
full blocks and page owners, the varlen prefill's FlashAttention call, the async decode loop, and a
step in flight that the host does not wait for."""

import pytest
import torch

from flexgemma import SamplingParams
from flexgemma.tasks.parity import hf_greedy

from conftest import gpu_engine, outputs_per_setting, random_prompts

pytestmark = pytest.mark.gpu


def test_graphs_equal_no_graphs(model, dtype, compile_glue):
    engine = gpu_engine(f"+model={model}", f"model.dtype={dtype}", "cudagraph.buckets=[1,2,4,8]",
                        f"engine.compile={compile_glue}")
    assert engine.runner.graphs is not None
    ps = random_prompts(engine.spec.vocab_size, lengths=(3, 20, 45, 70, 9))
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
        return gpu_engine("+model=tiny", "model.dtype=float32", "model.hf_config.sliding_window=512",
                          "model.hf_config.max_position_embeddings=2048", "cudagraph=off", *extra)

    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    runs = outputs_per_setting(build, "kernels.prefill_full_blocks", (False, True), random_prompts(512), sp)
    for plain, fast in zip(*runs):
        assert plain.token_ids == fast.token_ids
        assert max(abs(a - b) for a, b in zip(plain.logprobs, fast.logprobs)) < 1e-4


def test_prefill_page_owners_change_nothing_but_speed():
    """kernels.prefill_page_check=owner through compiled flex, as the test above: prompts packed into
    shared query blocks, pages of both layer types; the same greedy tokens and logprobs as the page table."""
    def build(*extra):
        return gpu_engine("+model=tiny", "model.dtype=float32", "model.hf_config.sliding_window=512",
                          "model.hf_config.max_position_embeddings=2048", "cudagraph=off", *extra)

    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    runs = outputs_per_setting(build, "kernels.prefill_page_check", ("table", "owner"), random_prompts(512), sp)
    for table, owner in zip(*runs):
        assert table.token_ids == owner.token_ids
        assert max(abs(a - b) for a, b in zip(table.logprobs, owner.logprobs)) < 1e-4


@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(256, 8, 1, 512), (256, 8, 1, 5), (128, 4, 2, None)])
def test_flash_varlen_computes_the_masks_attention(head_dim, heads, kv_heads, window):
    """kernels.prefill_attention=varlen's FlashAttention call in bf16 against the same mask in float32
    (varlen_reference): no further from it than SDPA in bf16 is. E2B's sliding geometry (8 query heads
    on one K/V head, window 512, a chunk past it), a window of 5 (one key too many would show), GQA 2:1;
    the second chunk after 70 cached keys (the causal mask aligned bottom-right), the padding a chunk."""
    from flexgemma.model.attention import VarlenPrefill, flash_varlen, varlen_reference

    torch.manual_seed(0)
    q_lens, k_lens = (7, 130, 600, 31), (7, 200, 600, 31)
    cu = lambda n: torch.tensor((0,) + n, device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    layout = VarlenPrefill(cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), None, window)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16) / head_dim ** 0.25
    # K and V as the engine reads them from a pool: [T, H, D] views of [H, T, D]
    k = (torch.randn(kv_heads, sum(k_lens), head_dim, device="cuda") / head_dim ** 0.25).bfloat16().transpose(0, 1)
    v = torch.randn(kv_heads, sum(k_lens), head_dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    want = varlen_reference(q.float(), k.float(), v.float(), layout)
    sdpa_gap = (varlen_reference(q, k, v, layout).float() - want).abs().max().item()
    gap = (flash_varlen(q, k, v, layout).float() - want).abs().max().item()
    assert gap <= 2 * sdpa_gap + 1e-3, (gap, sdpa_gap)


def test_varlen_prefill_scores_as_flex_does():
    """kernels.prefill_attention=varlen through the engine (both of the tiny model's layer types, head_dim
    32 and 64): teacher-forced logprobs of prompts split over 96-token prefill steps (chunks after
    earlier chunks, the 16-token window crossed) no further from float32 flex than bf16 flex is."""
    def scores(dtype, attention):
        engine = gpu_engine("+model=tiny", f"model.dtype={dtype}", "cudagraph=off", "engine.max_prefill_tokens=96",
                            f"kernels.prefill_attention={attention}")
        prompts = random_prompts(engine.spec.vocab_size, lengths=(7, 130, 300, 41))
        return torch.tensor([x for s in engine.score(prompts, [1] * len(prompts)) for x in s.logprobs])

    want = scores("float32", "flex")
    flex_gap = (scores("bfloat16", "flex") - want).abs()
    varlen_gap = (scores("bfloat16", "varlen") - want).abs()
    assert varlen_gap.mean() <= 2 * flex_gap.mean() + 1e-3, (varlen_gap.mean(), flex_gap.mean())
    assert varlen_gap.max() <= 2 * flex_gap.max() + 1e-2, (varlen_gap.max(), flex_gap.max())


def test_async_decode_with_graphs_equals_sync():
    engine = gpu_engine("+model=tiny", "cudagraph.buckets=[1,2,4,8]")
    ps = random_prompts(engine.spec.vocab_size, lengths=(3, 20, 45, 70, 9))
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

    engine = gpu_engine("+model=tiny", "cudagraph=off")
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
