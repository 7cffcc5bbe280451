"""Prefix caching (kv.prefix_cache): shared prompt pages give the tokens and logprobs of computing
every prompt, GRPO groups are prefilled once, nothing is written where another request reads, a
weight change is never a hit, and no page leaks."""

import random

import pytest
import torch

from flexgemma import SamplingParams
from flexgemma.engine.kv_cache import PageAllocator
from flexgemma.tasks.common import prefix_metrics
from flexgemma.tasks.drift import perturbed

from conftest import make_engine  # kv.prefix_cache is on by default

PAGE = 8  # conftest SMALL: kv.page_size=8; tiny and tiny_moe slide over 16 tokens
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=5, ignore_eos=True)


def rand_prompt(rng, n):
    return [2] + [rng.randrange(3, 500) for _ in range(n - 1)]


def workload():
    """n copies, prompts sharing only a prefix, prompts longer than the sliding window, a short one."""
    rng = random.Random(0)
    base = rand_prompt(rng, 45)
    return ([base] * 4
            + [base[:27] + rand_prompt(rng, 14)[1:], base[:16] + rand_prompt(rng, 30)[1:]]
            + [rand_prompt(rng, 60), [2, 9, 4]] + [base[:40]] * 2)


def run(engine, prompts, params):
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def assert_same(a, b):
    (ta, la), (tb, lb) = a, b
    assert ta == tb
    for x, y in zip(la, lb):
        assert max((abs(p - q) for p, q in zip(x, y)), default=0.0) <= 1e-5


def free_pages(engine):
    return [g.allocator.num_free for g in engine.runner.cache.page_groups]


def no_references(engine):
    return all(not any(g.allocator.refs) for g in engine.runner.cache.page_groups)


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_same_tokens_and_logprobs_with_and_without_the_cache(model, params):
    prompts = workload()
    off = make_engine("kv.prefix_cache=false", model=model)
    on = make_engine(model=model)
    want = run(off, prompts, params)
    assert off.stats.prefix_hit_tokens == 0
    assert_same(run(on, prompts, params), want)
    first = on.stats
    assert first.prefix_hit_tokens > 0 and first.shared_pages_peak > 0
    assert first.prefill_tokens < off.stats.prefill_tokens
    assert first.prefix_hit_tokens + first.prefill_tokens == off.stats.prefill_tokens
    # across calls: the second call finds every prompt's full pages cached
    assert_same(run(on, prompts, params), want)
    assert on.stats.prefix_hit_tokens > first.prefix_hit_tokens
    # SamplingParams(n=...) copies share as separate copies do
    sp = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    on.reset_prefix_cache()
    a = on.generate([prompts[0]], sp)[0]
    b = off.generate([prompts[0]], sp)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert max(abs(x - y) for c, d in zip(a.outputs, b.outputs) for x, y in zip(c.logprobs, d.logprobs)) <= 1e-5
    # 45 tokens: 5 full pages shared, the last page's 4 tokens copied; each copy computes its last token
    assert on.stats.prefix_hit_tokens == 3 * 44 and on.stats.prefill_tokens == 45 + 3


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_preemption_in_a_tiny_pool_gives_the_same_tokens(model):
    prompts = workload()
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    small = ("kv.cpu_pages=24", "engine.max_model_len=128", "engine.max_batch_size=8")
    off = make_engine("kv.prefix_cache=false", *small, model=model)
    on = make_engine(*small, model=model)
    want = run(off, prompts, params)
    start = free_pages(on)
    assert_same(run(on, prompts, params), want)
    assert on.stats.preemptions > 0 and on.stats.prefix_hit_tokens > 0
    assert off.stats.preemptions > 0
    assert free_pages(on) == start and no_references(on)


def test_a_grpo_group_is_prefilled_once():
    engine = make_engine()
    prompt = rand_prompt(random.Random(3), 45)
    engine.generate([prompt] * 8, SAMPLED)
    st = engine.stats
    # the first copy computes 45 tokens; each other copy only its last token (40 shared, 4 copied)
    assert st.prefill_tokens == 45 + 7 * 1
    assert st.prefix_hit_tokens == 7 * 44
    m = prefix_metrics(st)
    assert m["kv/prefix_hit_rate"] == pytest.approx(308 / (308 + 52))
    assert m["throughput/prefill_tokens_computed"] == 52 and m["kv/shared_pages_peak"] >= 5
    # the prompt's full-attention pages are held once: 5 shared + each copy's own tail
    off = make_engine("kv.prefix_cache=false")
    off.generate([prompt] * 8, SAMPLED)
    assert st.kv_peak_pages["full"] < off.stats.kv_peak_pages["full"] - 6 * 5
    # prompt KV alone (memory/kv_prompt_peak_gib), in pages of 8: 5 full pages once + 8 tails of 5 tokens
    assert st.kv_prompt_peak_pages["full"] == 5 + 8 * 5 / 8 and off.stats.kv_prompt_peak_pages["full"] == 8 * 45 / 8


def test_a_repeated_prompt_after_update_lora_is_not_a_hit():
    prompts = workload()[:5]
    engine = make_engine("lora=r16")
    run(engine, prompts, GREEDY)
    run(engine, prompts, GREEDY)
    assert engine.stats.prefill_tokens < sum(len(p) for p in prompts)  # hits before the update
    new = perturbed(engine.lora.state_dict(), 0.5, seed=3)
    engine.update_lora(new)
    got = run(engine, prompts, GREEDY)
    # the copies of prompt 0 share within the call, but nothing from before the update is reused
    fresh = make_engine("lora=r16", "kv.prefix_cache=false")
    fresh.update_lora(new)
    assert_same(got, run(fresh, prompts, GREEDY))
    assert engine.stats.prefix_hit_tokens + engine.stats.prefill_tokens == fresh.stats.prefill_tokens
    # only what this call computed: the 3 later copies of prompt 0 (5 full pages and 4 tokens of its
    # last page, copied), and prompt 4's 27 tokens of it (3 full pages)
    assert engine.stats.prefix_hit_tokens == 3 * 44 + 3 * PAGE


def test_weights_changed_forgets_every_page_and_hashes_differ():
    engine = make_engine()
    prefix = engine.scheduler.prefix
    tokens = list(range(3, 3 + 4 * PAGE))
    before = prefix.hashes(tokens)
    engine.generate([tokens], GREEDY)
    assert len(prefix) == 4
    engine.weights_changed()
    assert len(prefix) == 0 and prefix.hashes(tokens)[0] != before[0]
    assert engine.runner.cache.page_groups[0].allocator.num_idle == 0


def test_no_write_lands_in_a_page_another_request_reads(monkeypatch):
    """Copy-on-write by construction: every KV slot a step writes (sink page aside) is in a page only
    the writing request holds, and not a cached page (whose KV later requests read)."""
    engine = make_engine()
    cache = engine.runner.cache
    pools = cache.pools
    layer_group = {s.index: cache.group_for[s.layer_type] for s in engine.spec.kv_layers}
    seen = []
    real_write = pools.write

    def checked_write(layer_index, k, v, slots):
        group = layer_group[layer_index]
        for page in set((slots // PAGE).tolist()) - {0}:
            seen.append(page)
            assert group.allocator.refs[page] == 1, f"{group.name} page {page} written while shared"
            assert page not in group.allocator._cached, f"{group.name} page {page} written while cached"
        return real_write(layer_index, k, v, slots)

    monkeypatch.setattr(pools, "write", checked_write)
    prompts = workload()
    engine.generate(prompts, SAMPLED)
    engine.generate(prompts + prompts[:3], SAMPLED)  # hits across calls too
    assert seen and engine.stats.shared_pages_peak > 0


def test_idle_cached_pages_are_evicted_before_anyone_is_preempted():
    engine = make_engine("kv.cpu_pages=40", "engine.max_batch_size=4")
    rng = random.Random(7)
    engine.generate([rand_prompt(rng, 60) for _ in range(2)], GREEDY)  # leaves 14 cached pages idle
    full = engine.runner.cache.page_groups[0].allocator
    assert full.num_idle == 14
    engine.generate([rand_prompt(rng, 60) for _ in range(4)], GREEDY)  # needs most of the pool
    assert engine.stats.preemptions == 0
    assert full.num_idle < 14 + 4 * 7


def test_allocator_counts_references_and_evicts_least_recently_released():
    a = PageAllocator(5)
    evicted = []
    a.on_evict = evicted.append
    p = a.allocate(3)  # pages 1, 2, 3
    a.share([p[0], p[1]])
    assert a.num_shared == 2 and a.num_free == 1
    for page in p:
        a.mark_cached(page)
    a.release(p)  # page 3 idle; 1 and 2 still held once
    a.release([p[1]])  # page 2 idle after page 3
    assert a.num_shared == 0 and a.num_free == 3 and a.num_idle == 2
    assert a.allocate(2) == [4, 3] and evicted == [3]  # the free page first, then the oldest idle one
    a.share([2])  # a hit takes an idle page back
    assert a.num_idle == 0 and a.refs[2] == 1
    with pytest.raises(RuntimeError, match="released more often"):
        a.release([4, 4])


@pytest.mark.parametrize("how", ["abort", "exception"])
def test_no_page_leaks_after_abort_or_exception(monkeypatch, how):
    engine = make_engine()
    start = free_pages(engine)
    prompts = workload()
    engine.generate(prompts, SAMPLED)  # fills the cache
    assert free_pages(engine) == start and no_references(engine)
    if how == "abort":
        ids = [engine.add_request(p, SAMPLED) for p in prompts]
        for _ in range(3):
            engine.step()
        for rid in ids:
            engine.abort(rid)
        while engine.has_work:  # a queued decode step (async decode) is read, in vain
            engine.step()
    else:
        calls = []

        def failing(real):
            def call(*a, **k):
                calls.append(a)
                if len(calls) == 3:  # mid-call: a decode step, with shared pages held
                    raise RuntimeError("injected")
                return real(*a, **k)
            return call

        monkeypatch.setattr(engine.runner, "run", failing(engine.runner.run))
        monkeypatch.setattr(engine.runner, "launch_decode", failing(engine.runner.launch_decode))
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(prompts, SAMPLED)
        monkeypatch.undo()
    assert free_pages(engine) == start and no_references(engine) and not engine.has_work
    assert_same(run(engine, prompts, SAMPLED), run(make_engine("kv.prefix_cache=false"), prompts, SAMPLED))


def test_score_never_starts_from_cached_pages():
    engine = make_engine()
    prompt = rand_prompt(random.Random(2), 33)
    engine.generate([prompt], GREEDY)
    got = engine.score([prompt], [1])[0].logprobs
    want = make_engine("kv.prefix_cache=false").score([prompt], [1])[0].logprobs
    assert len(got) == 32 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_gpu_cuda_graphs_and_flex_kernels_with_the_cache_equal_without(model):
    """On the GPU: compiled flex prefill/decode and CUDA-graph decode read shared pages (64-token pages)."""
    from flexgemma import build_engine, compose

    def engine_for(*overrides):
        return build_engine(compose([f"+model={model}", "device=cuda", "kv.max_pages=160", "model.dtype=float32",
                                     "engine.max_model_len=1024", "engine.max_batch_size=8",
                                     "cudagraph.buckets=[1,2,4,8]", *overrides]))

    rng = random.Random(0)
    base = rand_prompt(rng, 200)
    prompts = [base] * 5 + [base[:130] + rand_prompt(rng, 90)[1:], rand_prompt(rng, 300), [2, 7, 9]]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    off, on = engine_for("kv.prefix_cache=false"), engine_for("kv.prefix_cache=true")
    assert on.runner.graphs is not None
    want = run(off, prompts, sp)
    assert_same(run(on, prompts, sp), want)
    assert on.stats.prefix_hit_tokens >= 4 * 192 and sum(on.runner.graphs.hits.values()) > 0
    assert_same(run(on, prompts, sp), want)  # every full page from the last call's cache


def test_a_prefill_block_lists_a_shared_page_once(monkeypatch):
    """Copies of a prompt prefill their last pages in one packed step and read the same cached pages:
    a query block must list each page once (flex visits a listed block as often as it is listed, and
    the scores of a page listed twice would count twice in the softmax; the dense CPU path ignores
    the lists, the GPU's flex kernels do not)."""
    from flexgemma.engine.block_mask import MaskBuilder

    seen = []
    build = MaskBuilder.prefill

    def spy(self, seqs, chunk_lens, padded_len):
        masks = build(self, seqs, chunk_lens, padded_len)
        for m in masks.values():
            for j in range(m.kv_num_blocks.shape[-1]):
                listed = m.kv_indices[0, 0, j, : int(m.kv_num_blocks[0, 0, j])].tolist()
                seen.append((len(seqs), listed))
        return masks

    monkeypatch.setattr(MaskBuilder, "prefill", spy)
    engine = make_engine()
    prompt = rand_prompt(random.Random(3), 45)
    engine.generate([prompt] * 4, GREEDY)
    assert engine.stats.prefix_hit_tokens >= 3 * 40
    shared_steps = [listed for n, listed in seen if n > 1]
    assert shared_steps, "no packed prefill step of several copies"
    assert all(len(listed) == len(set(listed)) for _, listed in seen)


def coverage_errors(mask, q_rows: int, kv_len: int, q_block: int, page: int, batch: int = 1) -> int:
    """Slots the GPU's block-sparse flex kernel would get wrong: a slot the mask_mod allows in a page
    its query block does not list (missed), or in a page listed twice (counted twice)."""
    kv = torch.arange(kv_len)[None, :]
    errors = 0
    for b in range(batch):
        allowed = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.arange(q_rows)[:, None], kv).expand(q_rows, kv_len)
        visits = torch.zeros(q_rows, kv_len, dtype=torch.long)
        for j in range(-(-q_rows // q_block)):
            for p in mask.kv_indices[b, 0, j, : int(mask.kv_num_blocks[b, 0, j])].tolist():
                visits[j * q_block:(j + 1) * q_block, p * page:(p + 1) * page] += 1
        errors += int((allowed & (visits != 1)).sum())
    return errors


def test_block_lists_cover_the_mask_once_in_a_chunked_grpo_rollout(monkeypatch):
    """What the GPU's flex kernels read, checked on the CPU (whose dense path ignores the block lists):
    at every prefill and decode step of GRPO groups whose prompts are prefilled in chunks, copies
    admitted as their pages are written and windows sliding over shared pages, each query's block
    lists hold every slot its mask allows exactly once."""
    from flexgemma.engine.block_mask import MaskBuilder

    errors, steps = [], {"prefill": 0, "decode": 0}
    prefill, fill_decode = MaskBuilder.prefill, MaskBuilder.fill_decode

    def check_prefill(self, seqs, chunk_lens, padded_len):
        masks = prefill(self, seqs, chunk_lens, padded_len)
        steps["prefill"] += 1
        errors.extend(coverage_errors(m, sum(chunk_lens), self.kv_len[t], self.q_block, self.page_size)
                      for t, m in masks.items())
        return masks

    def check_decode(self, buf, seqs, rows):
        fill_decode(self, buf, seqs, rows)
        steps["decode"] += 1
        errors.extend(coverage_errors(m, 1, self.kv_len[t], 1, self.page_size, batch=len(seqs))
                      for t, m in self.block_masks(buf, rows).items())

    monkeypatch.setattr(MaskBuilder, "prefill", check_prefill)
    monkeypatch.setattr(MaskBuilder, "fill_decode", check_decode)
    engine = make_engine("engine.max_prefill_tokens=96", "engine.max_batch_size=32", "kv.cpu_pages=300")
    rng = random.Random(0)
    prompts = [p for _ in range(4) for p in [rand_prompt(rng, rng.randrange(40, 90))] * 4]
    engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True))
    assert engine.stats.prefix_hit_tokens > 0 and steps["prefill"] > 2 and steps["decode"] >= 9
    assert sum(errors) == 0


def test_an_in_place_weight_change_is_noticed_without_being_told():
    """An optimizer step (or any in-place change of a parameter) between calls forgets the cached
    pages although nobody called weights_changed(): the repeated prompt is computed again, and its
    logprobs are those of computing it with the new weights."""
    engine = make_engine()
    prompt = rand_prompt(random.Random(4), 45)
    engine.generate([prompt], GREEDY)
    engine.generate([prompt], GREEDY)
    assert engine.stats.prefix_hit_tokens == 40  # unchanged weights: a hit
    weight = engine.model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        weight.mul_(1.5)  # what optimizer.step() does: an in-place update
    got = engine.generate([prompt], GREEDY)[0]
    assert engine.stats.prefix_hit_tokens == 0
    engine.reset_prefix_cache()
    want = engine.generate([prompt], GREEDY)[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    engine.generate([prompt], GREEDY)
    assert engine.stats.prefix_hit_tokens == 40  # and the new weights' pages are hits again


def test_replay_schedule_shows_copies_prefilled_after_their_first():
    """experiments/replay_schedule.py (the scheduler alone): a group's first copy is prefilled (in
    chunks when long), its other copies in a later step, each only its last token (its last page
    copied from the first's)."""
    import importlib.util
    from conftest import ROOT

    path = ROOT / "experiments" / "replay_schedule.py"
    spec = importlib.util.spec_from_file_location("replay_schedule", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    steps = mod.main(["--lengths", "150,90", "--n", "3", "--page-size", "16", "--max-prefill-tokens", "128"])
    firsts = [(p, k) for step in steps for p, c, k in step if c == 0]
    copies = [(i, p, k) for i, step in enumerate(steps) for p, c, k in step if c]
    assert sum(k for p, k in firsts if p == 0) == 150 and sum(k for p, k in firsts if p == 1) == 90
    assert sorted(k for _, p, k in copies if p == 0) == [1, 1] and sorted(k for _, p, k in copies if p == 1) == [1, 1]
    last_first = {p: max(i for i, step in enumerate(steps) for q, c, _ in step if q == p and c == 0) for p in (0, 1)}
    assert all(i > last_first[p] for i, p, _ in copies)


def test_a_copy_gets_its_own_copy_of_the_last_page():
    """Copy-on-write of a prompt's last, partial page: each later copy of a GRPO group gets a page
    of its own holding a copy of the first copy's (which keeps writing its own), in every group."""
    engine = make_engine()
    cache = engine.runner.cache
    seen, copy_pages = [], cache.copy_pages

    def spy(copies):
        seen.extend(copies)
        copy_pages(copies)

    cache.copy_pages = spy
    engine.generate([rand_prompt(random.Random(3), 45)] * 3, GREEDY)
    for g in cache.page_groups:
        pairs = [(src, dst) for name, src, dst in seen if name == g.name]
        sources, dests = {s for s, _ in pairs}, {d for _, d in pairs}
        assert len(pairs) == 2 and len(sources) == 1 and len(dests) == 2 and not sources & dests
    assert engine.stats.prefill_tokens == 45 + 2


def test_only_running_requests_are_listed_as_last_page_sources():
    """A finished request's last page is gone: it leaves the list of copy sources (which would
    otherwise grow with every distinct prompt a long-lived engine sees)."""
    engine = make_engine()
    rng = random.Random(5)
    engine.generate([rand_prompt(rng, 45) for _ in range(6)], GREEDY)
    assert engine.scheduler.prefix._tails == {}
