"""The API an RL trainer reaches for (issue 19): text in and out, n completions, stop strings,
score(), sleep()/wake(), engines from Python arguments or a transformers model, outputs_to_dataset.

The tiny model gets a tiny tokenizer built here with `tokenizers` (a word-level vocabulary of 512
entries: specials, a few words, letters and letter pairs), saved with the model's weights into a
checkpoint directory that model.path loads."""

import itertools
import json
import string
import sys

import pytest
import torch

from flexgemma import Engine, RequestError, SamplingParams, build_engine, compose, outputs_to_dataset
from flexgemma.engine.sequence import child_seed

from conftest import SMALL, make_engine

PROMPT = [2, 17, 99, 301, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
SMALL_KW = {"kv.page_size": 8, "kv.cpu_pages": 80, "engine.max_model_len": 256, "device": "cpu"}
CHAT = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}" \
       "{% if add_generation_prompt %}model{% endif %}"


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<bos>", "<unk>"]  # tiny's pad 0, eos 1, bos 2
    vocab += ["▁" + w for w in "hello world the cat sat on a mat user model".split()]
    vocab += list(string.ascii_lowercase) + ["▁"]
    vocab += ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)][: 512 - len(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=CHAT)


def tiny_hf_model(seed: int = 7):
    from transformers import Gemma4ForCausalLM

    from flexgemma.model.load import text_config_from_dict

    config = text_config_from_dict(dict(compose(["+model=tiny"]).model.hf_config))
    torch.manual_seed(seed)
    return Gemma4ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_with_tokenizer")
    tiny_hf_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(ckpt):
    return build_engine(compose(["+model=tiny", f"model.path={ckpt}", *SMALL]))


def greedy(n=24, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# -- text in and out ----------------------------------------------------------------------------
def test_text_round_trip(engine):
    tok = engine.tokenizer
    out = engine.generate(["hello world"], greedy())[0]
    assert out.prompt_token_ids == [2, 4, 5] and out.prompt == "hello world"
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True) and out.text
    assert out.outputs[0].text == out.text
    same = engine.generate([[2, 4, 5]], greedy())[0]
    assert same.token_ids == out.token_ids and same.text == out.text and same.prompt is None
    chat = [{"role": "user", "content": "hello cat"}]
    c = engine.generate([chat], greedy(8))[0]
    assert c.prompt_token_ids == [2, 12, 4, 7, 13]  # <bos> user ▁hello ▁cat model
    assert c.prompt == "<bos>user hello cat model"


def test_text_needs_a_tokenizer(tiny_engine):
    bare = make_engine("model.tokenizer=null")  # tiny without its shipped tokenizer
    out = bare.generate(["hello"], greedy(4))[0]
    assert out.finish_reason == "error" and "no tokenizer" in out.error
    with pytest.raises(RequestError, match="no tokenizer"):
        bare.add_request("hello")
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        bare.add_request([2, 5], SamplingParams(stop=["x"]))
    with pytest.raises(RequestError, match="wrap it in a list"):
        tiny_engine.generate([{"role": "user", "content": "hi"}])


# -- n completions ----------------------------------------------------------------------------
def test_n_completions_equal_separate_seeded_requests(engine):
    sp = SamplingParams(n=8, seed=11, max_new_tokens=16, ignore_eos=True)
    out = engine.generate([PROMPT], sp)[0]
    assert [c.index for c in out.outputs] == list(range(8))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 8  # distinct seeds, distinct samples
    seeds = [child_seed(11, i) for i in range(8)]
    assert seeds[0] == 11 and len(set(seeds)) == 8
    engine.reset_prefix_cache()  # the same sharing as the first call (a hit of its pages rounds differently)
    alone = engine.generate([PROMPT] * 8, [SamplingParams(seed=s, max_new_tokens=16, ignore_eos=True) for s in seeds])
    for c, a in zip(out.outputs, alone):
        assert c.token_ids == a.token_ids and c.logprobs == a.logprobs and c.text == a.text
    # n=1 readers: the first completion's fields
    assert out.token_ids == out.outputs[0].token_ids and out.logprobs == out.outputs[0].logprobs
    assert out.finish_reason == out.outputs[0].finish_reason == "length" and out.text == out.outputs[0].text


def test_n_through_the_step_api_and_abort(engine):
    rid = engine.add_request(PROMPT, SamplingParams(n=3, seed=5, max_new_tokens=6, ignore_eos=True))
    done = []
    while engine.has_work:
        done += engine.step()
    assert len(done) == 1 and done[0].request_id == rid and len(done[0].outputs) == 3
    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_new_tokens=50))
    engine.step()
    out = engine.abort(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(g.in_use == 0 for g in engine.scheduler.cache.page_groups)
    with pytest.raises(ValueError, match="n=0"):  # refused when built
        SamplingParams(n=0)
    bad = SamplingParams()
    bad.n = 0  # set afterwards: the engine checks again
    with pytest.raises(RequestError, match="n=0"):
        engine.add_request(PROMPT, bad)


# -- stop strings -------------------------------------------------------------------------------
def _boundary_stop(tok, ids):
    """A 2-character stop string across the boundary of tokens k and k+1, first seen there."""
    full = tok.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids) - 2):
        b = len(tok.decode(ids[:k + 1], skip_special_tokens=True))
        stop = full[b - 1:b + 1]
        if len(stop) == 2 and " " not in stop and full.find(stop) == b - 1 \
                and len(tok.decode(ids[:k], skip_special_tokens=True)) < b - 1:
            return k, b, stop, full
    raise AssertionError("no boundary stop string in this completion")


def test_stop_string_across_token_boundaries(engine):
    tok = engine.tokenizer
    ids = engine.generate([PROMPT], greedy(32))[0].token_ids
    k, b, stop, full = _boundary_stop(tok, ids)
    out = engine.generate([PROMPT], greedy(32, stop=["zzzzzz", stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == ids[:k + 2]  # generation ends at the token that completes the match
    assert out.text == full[:b - 1]  # the stop string is not in the text
    inc = engine.generate([PROMPT], greedy(32, stop=[stop], include_stop_str_in_output=True))[0]
    assert inc.text == full[:b + 1] and inc.token_ids == ids[:k + 2]
    never = engine.generate([PROMPT], greedy(32, stop=["zzzzzz"]))[0]
    assert never.finish_reason == "length" and never.text == full


class ByteTokenizer:
    """Token i is byte i: a character of several UTF-8 bytes spans tokens (its first tokens alone
    decode to U+FFFD, as with byte-level BPE)."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_matcher_waits_for_split_characters():
    from flexgemma.engine.text import StopMatcher

    ids = list("ab".encode()) + list("é!".encode()) + list("cd".encode())  # é is 2 bytes: 2 tokens
    m = StopMatcher(ByteTokenizer(), ("é!", "zz"))
    hits = [m.matched(ids[:k]) for k in range(1, len(ids) + 1)]
    assert hits == [False] * 4 + [True] * 3  # matched at the token of "!"
    assert m.final_text(False) == "ab" and m.final_text(True) == "abé!"
    m = StopMatcher(ByteTokenizer(), ("\ufffd",))
    assert not m.matched(list("é".encode())[:1])  # a half character is not text yet


# -- score --------------------------------------------------------------------------------------
def test_score_equals_generate_and_transformers(engine):
    outs = engine.generate([PROMPT, PROMPT[:5]], SamplingParams(n=2, seed=3, max_new_tokens=20, ignore_eos=True))
    seqs, plens, want = [], [], []
    for o in outs:
        for c in o.outputs:
            seqs.append(o.prompt_token_ids + c.token_ids)
            plens.append(len(o.prompt_token_ids))
            want.append(c.logprobs)
    scores = engine.score(seqs, plens, top_k=4)
    for s, w, seq, p in zip(scores, want, seqs, plens):
        assert s.token_ids == seq[p:]
        assert max(abs(a - b) for a, b in zip(s.logprobs, w)) <= 1e-5
    assert all(g.in_use == 0 for g in engine.scheduler.cache.page_groups)  # score freed its pages
    with torch.no_grad():
        ref = torch.log_softmax(engine.model(torch.tensor([seqs[0]])).logits[0].float(), -1)
    p = plens[0]
    hf = ref[p - 1:-1].gather(-1, torch.tensor(seqs[0][p:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores[0].logprobs), hf, atol=1e-4, rtol=0)
    top = scores[0].top_logprobs[0]
    assert [t for t, _ in top] == ref[p - 1].topk(4).indices.tolist()
    assert abs(top[0][1] - ref[p - 1].max().item()) <= 1e-4
    with pytest.raises(RequestError, match="prompt_len"):
        engine.score([[2, 5]], [2])


def test_score_batches_larger_than_the_pool(engine):
    """Six 200-token sequences (1200 tokens) through an 80-page pool of 8 (640 tokens): they queue
    for pages, and each scores as it does alone."""
    g = torch.Generator().manual_seed(0)
    seqs = [[2] + torch.randint(4, 512, (199,), generator=g).tolist() for _ in range(6)]
    plens = [1, 50, 120, 198, 7, 100]
    batched = engine.score(seqs, plens)
    for s, p, b in zip(seqs, plens, batched):
        alone = engine.score([s], [p])[0]
        assert len(b.logprobs) == 200 - p
        assert max(abs(x - y) for x, y in zip(b.logprobs, alone.logprobs)) <= 1e-5
    assert all(g.in_use == 0 for g in engine.scheduler.cache.page_groups)


@pytest.mark.parametrize("invariant", [False, True])
def test_score_takes_the_head_in_parts_of_rows(monkeypatch, invariant):
    """A step's scored rows go through the LM head and the log-probabilities in parts (bounded memory on a
    262k vocabulary): parts of 3 rows give what one part gives, bit for bit under engine.batch_invariant,
    top-k and routed experts included."""
    from flexgemma.engine import score as score_mod

    engine = make_engine(f"engine.batch_invariant={str(invariant).lower()}", model="tiny_moe")
    g = torch.Generator().manual_seed(1)
    seqs = [[2] + torch.randint(4, 512, (n,), generator=g).tolist() for n in (40, 13, 70)]
    plens = [5, 1, 30]
    whole = engine.score(seqs, plens, top_k=3, return_routed_experts=True)
    monkeypatch.setattr(score_mod, "HEAD_PART_BYTES", 3 * 4 * engine.spec.vocab_size)
    assert score_mod.head_part_rows(engine.spec.vocab_size) == 3
    parts = engine.score(seqs, plens, top_k=3, return_routed_experts=True)
    for a, b in zip(whole, parts):
        assert len(a.logprobs) == len(b.logprobs) > 3 and (a.routed_experts == b.routed_experts).all()
        if invariant:
            assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
        else:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
            assert [[t for t, _ in r] for r in a.top_logprobs] == [[t for t, _ in r] for r in b.top_logprobs]


# -- sleep / wake -------------------------------------------------------------------------------
def test_sleep_wake_round_trip(engine):
    """On the CPU the pool's storage is resized to nothing and back (engine.sleep_mode, CUDA virtual
    memory, only changes the GPU path)."""
    params = [greedy(20), SamplingParams(seed=9, max_new_tokens=20, ignore_eos=True)]
    before = engine.generate([PROMPT, PROMPT[:7]], params)
    pool = engine.runner.cache.pools
    report = engine.sleep()
    assert report["kv_pool_bytes"] == pool.nbytes > 0
    assert all(k.untyped_storage().nbytes() == 0 for k, _ in pool._kv.values())
    for call in (lambda: engine.generate([PROMPT]), lambda: engine.add_request(PROMPT), engine.step,
                 lambda: engine.score([PROMPT], [3]), engine.sleep):
        with pytest.raises(RuntimeError, match="asleep"):
            call()
    assert engine.wake()["recaptured"] is False  # no CUDA graphs on the CPU
    with pytest.raises(RuntimeError, match="not asleep"):
        engine.wake()
    after = engine.generate([PROMPT, PROMPT[:7]], params)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]


# -- building from Python ------------------------------------------------------------------------
def test_builder_keywords_leave_the_callers_hydra_alone(tmp_path, tiny_engine):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "app.yaml").write_text("lr: 0.5\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        mine = GlobalHydra.instance()
        eng = build_engine(model="tiny", **SMALL_KW)
        assert GlobalHydra.instance() is mine and mine.is_initialized()
        assert hydra_compose(config_name="app").lr == 0.5  # the caller's config search path still works
    assert eng.info["name"] == "tiny"
    want = tiny_engine.generate([PROMPT], greedy())[0].token_ids
    assert eng.generate([PROMPT], greedy())[0].token_ids == want
    with pytest.raises(TypeError, match="not both"):
        build_engine(compose(["+model=tiny", *SMALL]), model="tiny")


def test_engine_from_a_transformers_model(engine):
    model = tiny_hf_model()
    keys = sorted(model.state_dict())
    eng = Engine.from_model(model, tokenizer=engine.tokenizer, engine__max_model_len=256,
                            **{"kv.page_size": 8, "kv.cpu_pages": 80})
    assert sorted(model.state_dict()) == keys  # the caller's modules were not rewritten
    assert eng.model is model and eng.runner.device.type == "cpu"
    a = eng.generate(["hello world"], greedy())[0]
    b = engine.generate(["hello world"], greedy())[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    with pytest.raises(Exception, match="Gemma4ForCausalLM"):
        Engine.from_model(torch.nn.Linear(2, 2))


# -- outputs_to_dataset ---------------------------------------------------------------------------
def test_outputs_to_dataset(engine, tmp_path, monkeypatch):
    outs = engine.generate(["hello world", [2, 7]], SamplingParams(n=2, seed=1, max_new_tokens=4, ignore_eos=True))
    ds = outputs_to_dataset(outs)
    assert len(ds) == 4 and ds[1]["completion_index"] == 1 and ds[1]["token_ids"] == outs[0].outputs[1].token_ids
    assert ds[0]["prompt"] == "hello world" and ds[2]["text"] == outs[1].outputs[0].text
    path = outputs_to_dataset(outs, tmp_path / "rollouts.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [dict(r) for r in ds]
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the package were not installed
    assert outputs_to_dataset(outs) == rows


@pytest.mark.gpu
@pytest.mark.parametrize("sleep_mode", [False, True])
def test_sleep_frees_the_kv_pool_on_the_gpu(sleep_mode):
    """E2B on the GPU: sleep gives back at least the KV pool, wake restores it, and the same requests
    give the same tokens. Without sleep_mode the graphs are re-captured when the caching allocator
    moved the pool; with it (CUDA virtual memory) the pool keeps its addresses and the graphs stay.
    Prints GiB freed, wake seconds and whether the graphs were re-captured."""
    eng = build_engine(model="e2b", device="cuda", **{"engine.max_model_len": 2048, "engine.sleep_mode": sleep_mode})
    assert (eng.runner.cache.virtual is not None) == sleep_mode
    prompts = [[2, 818, 5279, 529, 7001] * 4, [2, 651, 1424]]
    params = [greedy(64), SamplingParams(seed=4, max_new_tokens=64, ignore_eos=True)]
    before = eng.generate(prompts, params)
    for cycle in range(3):  # an RL loop sleeps and wakes every step
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        report = eng.sleep()
        freed = torch.cuda.mem_get_info()[0] - free
        woke = eng.wake()
        print(f"\nsleep_mode={sleep_mode} cycle {cycle}: KV pool {report['kv_pool_bytes'] / 2**30:.2f} GiB, "
              f"freed {freed / 2**30:.2f} GiB (driver); wake {woke['seconds']:.3f} s, "
              f"graphs re-captured: {woke['recaptured']}")
        assert freed >= report["kv_pool_bytes"]
        if sleep_mode:
            assert woke["recaptured"] is False
        after = eng.generate(prompts, params)
        assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_token_times_give_itl_percentiles(tiny_engine):
    """Each completion carries one arrival time per token, non-decreasing and after its first
    token's; the round's ITL is every completion's gaps (the n of a request included), and the
    summary gives its mean, p50, p90 and p99 as for TTFT and TPOT."""
    import numpy as np

    from flexgemma.tasks.bench import round_summary
    from flexgemma.tasks.common import round_metrics

    prompts = [[2, 5, 9, 14], [2, 77, 31, 8, 8, 9]]
    outs = tiny_engine.generate(prompts, SamplingParams(max_new_tokens=7, temperature=1.0, seed=3, n=2,
                                                        ignore_eos=True))
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            t = c.token_times
            assert len(t) == len(c.token_ids) == 7 and all(b >= a for a, b in zip(t, t[1:]))
        assert o.first_token_time == pytest.approx(min(c.token_times[0] for c in o.outputs))
    m, lat = round_metrics(outs, tiny_engine.stats, wall=1.0)
    gaps = np.concatenate([np.diff(c.token_times) * 1e3 for o in outs for c in o.outputs])
    assert lat["latency/itl_ms"].size == 4 * 6 and m["latency/itl_mean_ms"] == pytest.approx(gaps.mean())
    m["bench/compiled_in_round"] = 0
    summary = round_summary([m], [lat])
    assert summary["latency/itl_p99_ms"] == pytest.approx(np.percentile(gaps, 99))
    assert summary["latency/itl_p50_ms"] <= summary["latency/itl_p90_ms"] <= summary["latency/itl_p99_ms"]


def test_token_times_survive_preemption():
    """A request preempted and recomputed keeps the times its tokens first arrived: one a token."""
    engine = build_engine(compose(["+model=tiny", *SMALL, "kv.cpu_pages=12", "engine.max_model_len=48",
                                 "engine.max_batch_size=4"]))
    outs = engine.generate([[2] + list(range(10 + 40 * i, 30 + 40 * i)) for i in range(3)], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                        ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) > 0
    for o in outs:
        t = o.outputs[0].token_times
        assert len(t) == len(o.token_ids) == 20 and all(b >= a for a, b in zip(t, t[1:]))
