"""KV pool sizing on a GPU: what the job can use at once, capped by memory (no GPU needed: the
free-memory query is the only CUDA call, and it is replaced here)."""

import pytest
import torch

from flexgemma import compose
from flexgemma.builder import _pool_sizes
from flexgemma.config.schema import ConfigError
from flexgemma.engine.kv_cache import KVCache, PoolDemand
from flexgemma.model.load import text_config_from_dict
from flexgemma.model.spec import ModelSpec
from flexgemma.tasks.workload import pool_demand

CUDA = torch.device("cuda")


def sizes(monkeypatch, free_bytes, *overrides, demand=PoolDemand()):
    cfg = compose(["+model=tiny", "kv.page_size=8", "engine.max_model_len=256", "engine.max_batch_size=32",
                   "engine.max_prefill_tokens=64", *overrides])
    spec = ModelSpec.from_hf_config(text_config_from_dict(dict(cfg.model.hf_config)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, free_bytes))
    return cfg, spec, _pool_sizes(cfg, spec, torch.bfloat16, CUDA, 256, demand)


def test_pool_holds_what_the_engine_limits_allow_not_the_whole_card(monkeypatch):
    _, spec, (full, window) = sizes(monkeypatch, 80e9)
    assert full == 32 * (256 // 8) + 1  # max_batch_size sequences of max_model_len, plus the sink page
    assert window == 32 * (16 // 8 + 2) + 64 // 8 + 1  # tiny's window is 16 tokens
    _, _, (card, _) = sizes(monkeypatch, 80e9, "kv.fit_demand=false")
    assert card > 100 * full  # without fit_demand the pool takes memory_fraction of the card


def test_pool_sized_for_the_workload_but_always_holds_one_longest_sequence(monkeypatch):
    _, _, (full, window) = sizes(monkeypatch, 80e9, demand=PoolDemand(seqs=4, tokens=20))
    assert full == 256 // 8 + 1  # 4 x 3 pages is less than one max_model_len sequence needs
    # its 4 sequences, and one prefill chunk's pages: of the job's longest prompt, not of max_prefill_tokens
    assert window == 4 * (20 // 8 + 2) + -(-20 // 8) + 1
    _, _, (full, _) = sizes(monkeypatch, 80e9, demand=PoolDemand(seqs=20, tokens=100))
    assert full == 20 * 13 + 1
    _, _, (full, _) = sizes(monkeypatch, 80e9, demand=PoolDemand(seqs=500, tokens=10_000))
    assert full == 32 * 32 + 1  # the engine's limits bound the demand


def test_memory_caps_the_pool_and_too_little_is_a_clear_error(monkeypatch):
    cfg, spec, _ = sizes(monkeypatch, 80e9)
    full_types = [t for t in spec.layer_types if t != "sliding_attention"]
    page = KVCache.page_bytes(spec, 8, torch.bfloat16, full_types)
    reserve = 2 << 30
    # room for 100 full pages after the activation reserve and the window group (one of each type)
    window_bytes = (32 * 4 + 9) * KVCache.page_bytes(spec, 8, torch.bfloat16, ["sliding_attention"])
    free = (reserve + window_bytes + 100.5 * page) / 0.9
    _, _, (full, _) = sizes(monkeypatch, free)
    assert full == 100
    with pytest.raises(ConfigError, match="kv.max_pages"):
        sizes(monkeypatch, (reserve + window_bytes + 10 * page) / 0.9)


def test_workload_demand():
    cfg = compose(["+model=tiny", "workload.num_prompts=16", "workload.n=2", "workload.max_prompt_len=48",
                   "workload.max_new_tokens=32"])
    assert pool_demand(cfg.workload) == PoolDemand(seqs=32, tokens=80)
    cfg = compose(["+model=tiny", "workload=jsonl", "workload.path=prompts.jsonl", "workload.num_prompts=null"])
    assert pool_demand(cfg.workload) == PoolDemand(seqs=None, tokens=None)


def test_idle_allocator_hands_out_pages_in_id_order_again():
    from flexgemma.engine.kv_cache import PageAllocator

    a = PageAllocator(6)
    first = a.allocate(3)
    second = a.allocate(2)
    a.release(second)
    a.release(first)  # the free list is now 4, 5, 1, 2, 3
    a.reset_order()
    assert a.allocate(5) == [1, 2, 3, 4, 5]  # placement no longer depends on what ran before
    b = PageAllocator(6)
    held = b.allocate(2)
    b.release(b.allocate(2)[::-1])
    b.reset_order()  # pages still in use: nothing moves
    assert b.allocate(2) == [5, 4] and held == [1, 2]


def test_request_longer_than_the_demand_gets_a_clear_error():
    """A pool sized for a job's short prompts: a longer prompt later is refused by name, not hung."""
    from flexgemma import SamplingParams, build_engine

    engine = build_engine(compose(["+model=tiny", "kv.page_size=8", "engine.max_model_len=512",
                                   "engine.max_prefill_tokens=256"]), PoolDemand(seqs=2, tokens=20))
    ok = engine.generate([[2, 5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert ok[0].finish_reason == "length"
    with pytest.raises(RuntimeError, match="raise kv.max_pages or lower engine.max_prefill_tokens"):
        engine.generate([[2] + [5] * 199], SamplingParams(max_new_tokens=4, temperature=0.0))
