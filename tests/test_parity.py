"""Greedy parity with transformers `generate` on the same weights, float32 on the CPU."""

import pytest
import torch

from flexgemma import SamplingParams
from flexgemma.tasks.parity import hf_greedy

from conftest import make_engine

NEW = 48


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # 1 token, short, crossing one page, longer than the window (16), many pages
    lengths = [1, 5, 9, 23, 41, 70]
    return [[2] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def check_parity(engine, prompts, **params):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, **params))
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length"
        assert o.token_ids == hf_greedy(engine.model, p, NEW), f"prompt of {len(p)} tokens diverged"
    return outs


def test_greedy_parity_tiny(tiny_engine):
    check_parity(tiny_engine, mixed_prompts(512))
    assert tiny_engine.stats.preemptions == 0


def test_greedy_parity_tiny_moe(tiny_moe_engine):
    check_parity(tiny_moe_engine, mixed_prompts(512, seed=1))


def test_greedy_parity_with_chunked_prefill_and_preemption():
    # 20 pages of 8 tokens: six requests of up to 118 tokens cannot all stay resident
    engine = make_engine("kv.cpu_pages=20", "engine.max_model_len=150", "engine.max_prefill_tokens=32")
    outs = check_parity(engine, mixed_prompts(512, seed=2))
    assert engine.stats.preemptions > 0, "the tiny pool should have forced preemption"
    assert engine.stats.prefill_steps > 3  # chunks of at most 32 tokens
    assert sum(o.num_preemptions for o in outs) == engine.stats.preemptions


def test_max_batch_size_is_respected_and_filled():
    engine = make_engine("engine.max_batch_size=3", "cudagraph=off")
    prompts = mixed_prompts(512, seed=3)
    check_parity(engine, prompts)
    sizes = engine.stats.decode_batch_sizes
    assert max(sizes) == 3
    # with 6 requests and batch 3, decode runs full until the queue drains
    assert sizes[0] == 3


def test_logprobs_match_transformers(tiny_engine):
    prompt = mixed_prompts(512)[3]
    out = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = tiny_engine.model(ids).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=1e-4)
