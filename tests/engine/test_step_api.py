"""The step API: add_request / step / has_work / abort, and generate() as a loop over them."""

import pytest

from flexgemma import RequestError, SamplingParams

from conftest import make_engine

PROMPTS = [[2, 10, 11, 12], [2] + list(range(40, 70)), [2, 7], [2] + list(range(100, 119))]
PARAMS = [
    SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=14, temperature=1.0, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=25, temperature=0.8, top_k=30, top_p=0.9, seed=6, ignore_eos=True),
    SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True),
]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    return make_engine(f"engine.async_decode={str(request.param).lower()}")


def free_pages(engine):
    return [g.allocator.num_free for g in engine.runner.cache.page_groups]


def all_free(engine):
    return [g.num_pages - 1 for g in engine.runner.cache.page_groups]


def test_requests_added_while_others_decode_give_generates_tokens(engine):
    want = engine.generate(PROMPTS, PARAMS)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2])]
    got, decoded = {}, engine.stats.decode_steps
    for _ in range(4):  # a prefill, then decode steps of the first two
        got.update({o.request_id: o for o in engine.step()})
    assert engine.stats.decode_steps > decoded and not got  # the first two are decoding, none is done
    ids += [engine.add_request(p, sp) for p, sp in zip(PROMPTS[2:], PARAMS[2:])]
    while engine.has_work:
        got.update({o.request_id: o for o in engine.step()})
    assert sorted(got) == sorted(ids)
    for rid, w in zip(ids, want):
        o = got[rid]
        assert (o.token_ids, o.finish_reason, o.prompt_token_ids) == (w.token_ids, w.finish_reason, w.prompt_token_ids)
        assert o.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert o.index == rid and o.first_token_time is not None
    assert free_pages(engine) == all_free(engine)
    assert engine.step() == [] and not engine.has_work


def test_async_step_api_chains_decode_steps():
    engine = make_engine("engine.async_decode=true")
    for p, sp in zip(PROMPTS, PARAMS):
        engine.add_request(p, sp)
    while engine.has_work:
        engine.step()
    assert engine.stats.chained_steps > 0


class FakeEvent:
    """A CUDA timing event stand-in: its time is the order it was made in, in ms."""

    def __init__(self, clock):
        self.t = next(clock)

    def elapsed_time(self, other) -> float:
        return float(other.t - self.t)


def test_async_decode_accounts_the_gpus_busy_and_idle_time():
    """scheduler/gpu_idle_pct and latency/decode_gpu_step_ms: each decode step's (start, end) events
    give its busy time; the gap from a step's end to the start of the step chained to it is idle time
    (the host was late queuing it). Fake events here, whose clock ticks once per event: a step takes
    1 ms, and the next step's start event is made right after its end, so chained gaps are 1 ms."""
    import itertools

    from flexgemma.tasks.common import gpu_decode_metrics

    engine = make_engine("engine.async_decode=true")
    clock = itertools.count()
    engine.runner._event = lambda: FakeEvent(clock)
    engine.generate(PROMPTS, PARAMS)
    st = engine.stats
    assert st.gpu_decode_steps == st.decode_steps > 0
    assert st.gpu_decode_busy == pytest.approx(st.decode_steps * 1e-3)
    # every chained step but the first of each chain has a 1 ms gap before it
    assert st.gpu_decode_idle == pytest.approx(st.chained_steps * 1e-3) and st.chained_steps > 0
    m = gpu_decode_metrics(st)
    assert m["latency/decode_gpu_step_ms"] == pytest.approx(1.0)
    assert m["scheduler/gpu_idle_pct"] == pytest.approx(100 * st.chained_steps / (st.decode_steps + st.chained_steps))
    assert gpu_decode_metrics(make_engine("engine.async_decode=true").stats) == {}  # nothing timed: no metric


def test_abort_frees_pages_and_keeps_the_others(engine):
    want = engine.generate(PROMPTS[:3], PARAMS[:3])
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], PARAMS[:3])]
    late = engine.add_request([2, 5, 6], SamplingParams(max_new_tokens=30))
    for _ in range(5):
        assert engine.step() == []
    out = engine.abort(ids[1])
    assert out.finish_reason == "abort" and out.request_id == ids[1]
    assert 0 < len(out.token_ids) < PARAMS[1].max_new_tokens
    assert out.token_ids == want[1].token_ids[: len(out.token_ids)]  # what it had, no placeholder
    assert len(out.logprobs) == len(out.token_ids)
    assert engine.abort(ids[1]) is None  # already gone
    got = {}
    while engine.has_work:
        got.update({o.request_id: o for o in engine.step()})
    assert sorted(got) == [ids[0], ids[2], late]
    assert got[ids[0]].token_ids == want[0].token_ids and got[ids[2]].token_ids == want[2].token_ids
    assert free_pages(engine) == all_free(engine)
    with pytest.raises(KeyError, match="no request with id 10000"):
        engine.abort(10000)


def test_abort_a_waiting_request_before_any_step(engine):
    rid = engine.add_request([2, 5, 6], SamplingParams(max_new_tokens=5))
    out = engine.abort(rid)
    assert (out.finish_reason, out.token_ids, out.prompt_token_ids) == ("abort", [], [2, 5, 6])
    assert not engine.has_work and free_pages(engine) == all_free(engine)


def test_invalid_add_request_raises_and_queues_nothing(engine):
    with pytest.raises(RequestError, match="token id 600 is outside the vocabulary"):
        engine.add_request([2, 600])
    bad = SamplingParams()
    bad.top_k = -1  # SamplingParams(top_k=-1) is refused when built; a value set afterwards is checked here
    with pytest.raises(RequestError, match="top_k=-1"):
        engine.add_request([2, 5], bad)
    assert not engine.has_work


def test_generate_refuses_while_step_requests_are_pending(engine):
    rid = engine.add_request([2, 5, 6], SamplingParams(max_new_tokens=3, temperature=0.0))
    engine.step()
    with pytest.raises(RuntimeError, match="needs an idle engine, but 1 requests added with add_request"):
        engine.generate([[2, 5]], SamplingParams(max_new_tokens=2))
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 3
