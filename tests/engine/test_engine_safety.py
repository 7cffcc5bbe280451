"""Nothing a caller does breaks the engine: complete request validation, transactional generate()
and step() (exceptions and Ctrl-C), and two threads on one engine."""

import math
import re
import threading

import numpy as np
import pytest
import torch

from flexgemma import RequestError, SamplingParams

from conftest import make_engine

PROMPTS = [[2, 10, 11, 12], [2] + list(range(40, 75)), [2, 7], [2] + list(range(100, 121))]
PARAMS = [
    SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=18, temperature=1.0, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=0.8, top_k=30, top_p=0.9, seed=6, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.7, ignore_eos=True),  # unseeded: its seed comes from its id
]


def mode(async_decode: bool) -> str:
    return f"engine.async_decode={str(async_decode).lower()}"


def free_pages(engine):
    return [g.allocator.num_free for g in engine.runner.cache.page_groups]


def tokens(outs):
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def fresh():
    """Outputs of a fresh engine's first call, per async_decode."""
    return {a: tokens(make_engine(mode(a)).generate(PROMPTS, PARAMS)) for a in (False, True)}


# -- validation -------------------------------------------------------------------------------------

BAD_PARAMS = [
    (dict(top_k=2**70), r"top_k=1180591620717411303424 must be in \[0, 9223372036854775807\]"),
    (dict(seed=2**70), r"seed=1180591620717411303424 must be in \[-9223372036854775808, 9223372036854775807\]"),
    (dict(seed="abc"), r"seed='abc' must be an integer \(got str\)"),
    (dict(temperature="hot"), r"temperature='hot' must be a finite number >= 0"),
    (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number >= 0"),
    (dict(temperature=math.inf), r"temperature=inf must be a finite number"),
    (dict(temperature=1e39), r"temperature=1e\+39 must be a finite number"),
    (dict(stop_token_ids=None), r"stop_token_ids=None must be a list or tuple of token ids"),
    (dict(stop_token_ids=5), r"stop_token_ids=5 must be a list or tuple"),
    (dict(stop_token_ids=(3, 1.5)), r"stop_token_ids holds 1.5"),
    (dict(stop_token_ids=(600,)), r"stop token id 600 is outside the vocabulary \[0, 512\)"),
    (dict(top_p=0), r"top_p=0 must be a number in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p=nan must be a number in \(0, 1\]"),
    (dict(top_p="1"), r"top_p='1' must be a number"),
    (dict(max_new_tokens=2.5), r"max_new_tokens=2.5 must be an integer \(got float\)"),
    (dict(max_new_tokens=True), r"max_new_tokens=True must be an integer \(got bool\)"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be in \[1, "),
    (dict(ignore_eos="yes"), r"ignore_eos='yes' must be True or False"),
]


def changed_params(**bad) -> SamplingParams:
    """Valid params whose fields are set afterwards: what SamplingParams refuses when built, the engine
    still checks (the dataclass is not frozen)."""
    sp = SamplingParams()
    for key, value in bad.items():
        setattr(sp, key, value)
    return sp


@pytest.mark.parametrize("bad,message", BAD_PARAMS, ids=[str(b) for b, _ in BAD_PARAMS])
def test_bad_sampling_values_are_named_and_never_poison_the_engine(tiny_engine, bad, message):
    if "outside the vocabulary" not in message:  # the vocabulary is the engine's to know
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    good = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = free_pages(tiny_engine)
    want = tiny_engine.generate([[2, 5, 6]], good)[0].token_ids
    outs = tiny_engine.generate([[2, 5, 6], [2, 9]], [good, changed_params(**bad)])
    assert outs[0].token_ids == want
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert outs[1].error.startswith("request 1: ")
    assert re.search(message, outs[1].error), outs[1].error
    with pytest.raises(RequestError, match=message):
        tiny_engine.generate([[2, 9]], changed_params(**bad), strict=True)
    with pytest.raises(RequestError, match=message):
        tiny_engine.add_request([2, 9], changed_params(**bad))
    assert tiny_engine.generate([[2, 5, 6]], good)[0].token_ids == want
    assert free_pages(tiny_engine) == before and not tiny_engine.has_work


def test_numpy_scalars_are_ints_and_floats(tiny_engine):
    plain = SamplingParams(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9, seed=11, ignore_eos=True,
                           stop_token_ids=(3,))
    numpy = SamplingParams(max_new_tokens=np.int32(7), temperature=np.float32(0.7), top_k=np.int64(5),
                           top_p=np.float64(0.9), seed=np.uint16(11), ignore_eos=np.bool_(True),
                           stop_token_ids=np.array([3]))
    assert numpy.problems() == []
    a, b = tiny_engine.generate([[2, 5, 6]] * 2, [plain, numpy])
    assert b.token_ids == a.token_ids and len(a.token_ids) >= 1


def test_prompts_as_numpy_and_torch_are_accepted(tiny_engine):
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [2, 40, 41, 42]
    forms = [prompt, tuple(prompt), [np.int64(t) for t in prompt], np.array(prompt, dtype=np.int32),
             torch.tensor(prompt), np.array([prompt])[0]]
    outs = tiny_engine.generate(forms, sp)
    assert all(o.finish_reason == "length" for o in outs)
    assert all(o.token_ids == outs[0].token_ids and o.prompt_token_ids == prompt for o in outs)


BAD_PROMPTS = [
    (b"hello", "prompt must be a list of token ids (ints), got bytes"),
    (None, "prompt must be a list of token ids (ints), got NoneType"),
    ([2, 5.0], "it holds 5.0 (float)"),
    ([2, True], "it holds True (bool)"),
    ([2, "5"], "it holds '5' (str)"),
    (np.array([[2, 5]]), "prompt must be 1-D token ids, got an array of shape (1, 2)"),
    (torch.tensor([2.0, 5.0]), "prompt must hold integer token ids, got dtype torch.float32"),
    (np.array([2.0, 5.0]), "prompt must hold integer token ids, got dtype float64"),
    ([2, -1], "token id -1 is outside the vocabulary [0, 512)"),
    (np.array([2, 2**40]), "token id 1099511627776 is outside the vocabulary"),
    ([], "empty prompt"),
    (list(range(2, 300)), "the maximum length is 256"),
]


@pytest.mark.parametrize("prompt,message", BAD_PROMPTS, ids=[m for _, m in BAD_PROMPTS])
def test_bad_prompts_are_named(tiny_engine, prompt, message):
    out = tiny_engine.generate([prompt, [2, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert out[0].finish_reason == "error" and message in out[0].error, out[0].error
    assert out[1].finish_reason == "length"
    with pytest.raises(RequestError, match="request 0: "):
        tiny_engine.generate([prompt], SamplingParams(max_new_tokens=3), strict=True)
    assert not tiny_engine.has_work


def test_prompts_that_are_not_a_list_of_prompts(tiny_engine):
    with pytest.raises(RequestError, match="prompts must be a list of prompts .* got int"):
        tiny_engine.generate(5)
    with pytest.raises(RequestError, match="2 prompts but 3 SamplingParams"):
        tiny_engine.generate([[2], [2]], [SamplingParams()] * 3)
    out = tiny_engine.generate([[2, 5], [2, 6]], [SamplingParams(max_new_tokens=2), {"max_new_tokens": 2}])
    assert out[0].finish_reason == "length" and "not a SamplingParams" in out[1].error
    assert not tiny_engine.has_work


# -- transactional generate() and step() ------------------------------------------------------------

class Injected(Exception):
    pass


def fail_on_call(engine, monkeypatch, method: str, n: int, exc):
    """Makes the runner's `method` raise `exc` on its n-th call from now."""
    real, calls = getattr(engine.runner, method), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, method, wrapper)
    return calls


CASES = [  # (async_decode, runner method, its call that fails)
    (False, "run", 4),  # a decode step, requests mid-generation
    (False, "run", 1),  # the first prefill
    (True, "launch_decode", 3),  # a chained launch, with a step in flight
    (True, "collect", 2),  # reading a step, with the next one queued
    (True, "run", 1),  # the prefill
]


@pytest.mark.parametrize("exc", [Injected, KeyboardInterrupt], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("async_decode,method,n", CASES, ids=[
    f"{'async' if a else 'sync'}-{m}{n}" for a, m, n in CASES])
def test_failed_generate_leaves_the_engine_as_it_was(fresh, monkeypatch, async_decode, method, n, exc):
    engine = make_engine(mode(async_decode))
    before = free_pages(engine)
    calls = fail_on_call(engine, monkeypatch, method, n, exc)
    with pytest.raises(exc, match="injected"):
        engine.generate(PROMPTS, PARAMS)
    assert len(calls) >= n  # it really failed mid-call
    monkeypatch.undo()
    assert free_pages(engine) == before and not engine.has_work
    assert all(not any(g.allocator.refs) for g in engine.runner.cache.page_groups)
    assert tokens(engine.generate(PROMPTS, PARAMS)) == fresh[async_decode]
    assert free_pages(engine) == before


@pytest.mark.parametrize("async_decode", [False, True], ids=["sync", "async"])
def test_failed_step_aborts_everything_and_the_engine_goes_on(fresh, monkeypatch, async_decode):
    engine = make_engine(mode(async_decode))
    before = free_pages(engine)
    for p, sp in zip(PROMPTS, PARAMS):
        engine.add_request(p, sp)
    for _ in range(3):
        engine.step()
    fail_on_call(engine, monkeypatch, "collect" if async_decode else "run", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        while engine.has_work:
            engine.step()
    monkeypatch.undo()
    assert free_pages(engine) == before and not engine.has_work
    out = engine.generate(PROMPTS[:3], PARAMS[:3])  # seeded and greedy: as a fresh engine's
    assert tokens(out) == fresh[async_decode][:3]


def test_interrupted_generate_does_not_return_its_requests_later(monkeypatch):
    """The bug of issue 16: after Ctrl-C, the next call returned the interrupted requests' outputs."""
    engine = make_engine(mode(False))
    fail_on_call(engine, monkeypatch, "run", 3, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    out = engine.generate([[2, 5]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(out) == 1 and out[0].prompt_token_ids == [2, 5] and len(out[0].token_ids) == 4


# -- threads ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("async_decode", [False, True], ids=["sync", "async"])
def test_two_threads_on_one_engine_are_serialised(async_decode):
    engine = make_engine(mode(async_decode))
    jobs = [(PROMPTS[:2], PARAMS[:2]), (PROMPTS[2:], PARAMS[1:3])]  # greedy and seeded: id-independent
    want = [tokens(engine.generate(p, sp)) for p, sp in jobs]
    got = [[], []]
    start = threading.Barrier(2)

    def work(k):
        start.wait()
        for _ in range(3):
            got[k].append(tokens(engine.generate(*jobs[k])))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [[want[0]] * 3, [want[1]] * 3]


def test_a_request_that_cannot_get_pages_is_a_clear_error_and_the_engine_goes_on(monkeypatch):
    engine = make_engine(mode(True))
    monkeypatch.setattr(engine.scheduler, "grow", lambda seq, upto: False)  # as if the pool were too small
    with pytest.raises(RuntimeError, match=r"request 0 \(4 tokens\) cannot get KV pages even with nothing else"):
        engine.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert not engine.has_work and free_pages(engine) == [g.num_pages - 1 for g in engine.runner.cache.page_groups]
    assert engine.generate([[2, 5]], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"


@pytest.mark.gpu
@pytest.mark.parametrize("method,n", [("collect", 3), ("launch_decode", 4)])
def test_gpu_interrupted_async_generate_with_graphs_recovers(monkeypatch, method, n):
    """On the GPU a failure leaves queued device work behind: it is drained, pages are freed, and
    the step API and the next generate() give a fresh engine's tokens (CUDA graphs, async decode)."""
    over = ["+model=tiny", "device=cuda", "kv.max_pages=128", "engine.max_model_len=256", "engine.max_batch_size=8",
            "cudagraph.buckets=[1,2,4,8]", "engine.async_decode=true"]
    from flexgemma import build_engine, compose

    want = tokens(build_engine(compose(over)).generate(PROMPTS, PARAMS))
    engine = build_engine(compose(over))
    before = free_pages(engine)
    fail_on_call(engine, monkeypatch, method, n, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, PARAMS)
    monkeypatch.undo()
    assert free_pages(engine) == before and not engine.has_work
    assert tokens(engine.generate(PROMPTS, PARAMS)) == want and engine.stats.chained_steps > 0
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], PARAMS[:3])]
    got = {}
    while engine.has_work:
        got.update({o.request_id: (o.token_ids, o.finish_reason) for o in engine.step()})
    assert [got[i] for i in ids] == want[:3]
