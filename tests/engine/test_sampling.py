import pytest
import torch

from flexgemma import SamplingParams
from flexgemma.engine.sampler import SamplingBatch, hash_uniform, sample


def prompts():
    return [[2, 10, 11, 12], [2, 40, 41], [2] + list(range(100, 130)), [2, 7]]


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_engine):
    ps = prompts()
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    a = [o.token_ids for o in tiny_engine.generate(ps, params)]
    b = [o.token_ids for o in tiny_engine.generate(ps, params)]
    assert a == b
    alone = tiny_engine.generate([ps[2]], [params[2]])[0].token_ids
    assert alone == a[2]
    rev = [o.token_ids for o in tiny_engine.generate(ps[::-1], params[::-1])][::-1]
    assert rev == a
    other_seed = tiny_engine.generate([ps[2]], [SamplingParams(max_new_tokens=24, temperature=1.0, seed=999,
                                                                ignore_eos=True)])[0].token_ids
    assert other_seed != a[2]


def test_sampling_differs_from_greedy_and_top_k_1_is_greedy(tiny_engine):
    ps = prompts()
    greedy = [o.token_ids for o in tiny_engine.generate(ps, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                           ignore_eos=True))]
    hot = [o.token_ids for o in tiny_engine.generate(ps, SamplingParams(max_new_tokens=16, temperature=2.0, seed=1,
                                                                        ignore_eos=True))]
    assert hot != greedy
    k1 = [o.token_ids for o in tiny_engine.generate(ps, SamplingParams(max_new_tokens=16, temperature=2.0, top_k=1,
                                                                       seed=1, ignore_eos=True))]
    assert k1 == greedy
    p0 = [o.token_ids for o in tiny_engine.generate(ps, SamplingParams(max_new_tokens=16, temperature=2.0,
                                                                       top_p=1e-6, seed=1, ignore_eos=True))]
    assert p0 == greedy


def batch(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=0, needs_filter=False):
    return SamplingBatch(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p), seed=torch.arange(n, dtype=torch.long) + seed,
        position=torch.full((n,), position, dtype=torch.long), needs_filter=needs_filter,
    )


def test_sampler_follows_the_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    n = 20000
    tokens, _ = sample(logits.expand(n, -1), batch(n))
    freq = torch.bincount(tokens, minlength=50).float() / n
    probs = torch.softmax(logits[0], -1)
    assert (freq - probs).abs().max() < 0.02
    tokens, _ = sample(logits.expand(n, -1), batch(n, top_k=5, needs_filter=True))
    assert set(tokens.tolist()) <= set(logits[0].topk(5).indices.tolist())
    tokens, _ = sample(logits.expand(n, -1), batch(n, top_p=0.5, needs_filter=True))
    order = probs.argsort(descending=True)
    keep = order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1]
    assert set(tokens.tolist()) <= set(keep.tolist())


def test_hash_uniform_is_uniform_and_pure():
    u = hash_uniform(torch.arange(64), torch.full((64,), 5), 4096)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    again = hash_uniform(torch.arange(64)[[3]], torch.tensor([5]), 4096)
    assert torch.equal(again[0], u[3])
    assert not torch.equal(hash_uniform(torch.tensor([3]), torch.tensor([6]), 4096)[0], u[3])


def test_the_uniforms_never_reach_0_or_1_and_the_noise_tail_keeps_its_resolution():
    """The hashes' float32 uniforms stay inside (0, 1) at both ends and every Gumbel noise is finite: the top
    31-bit hashes once rounded to 1.0, an infinite noise that drew its token whatever the logits. The large
    noise (the likely winner's) comes from small uniforms, exact in float32: neighbouring hashes give distinct
    noise there, where -log(-log(u)) from u near 1 gave one value to 128 neighbouring hashes."""
    from flexgemma.engine.sampler import gumbel_noise, unit_interval

    h = torch.tensor([0, 1, 2, 3, 2**31 - 129, 2**31 - 65, 2**31 - 64, 2**31 - 1])
    u = unit_interval(h)
    assert (u > 0).all() and (u < 1).all(), u
    noise = gumbel_noise(u)
    assert torch.isfinite(noise).all(), noise
    assert noise[0] > noise[1] > noise[2] > noise[3] > 20  # the tail: one noise per hash
    assert noise[-1] == noise[-2] < -2.5  # held below 1: the noise that never wins
    # Gumbel(0, 1): mean 0.5772, variance pi^2 / 6
    many = gumbel_noise(hash_uniform(torch.arange(8), torch.full((8,), 3), 1 << 16))
    assert abs(many.mean().item() - 0.5772) < 0.01 and abs(many.var().item() - 1.6449) < 0.03


def test_chunked_row_reductions_equal_torch():
    """The sampler reduces over the vocabulary in chunks (GPU parallelism): the same argmax (ties
    resolved to the first index, as torch) and the same logsumexp."""
    from flexgemma.engine.sampler import argmax_rows, logsumexp_rows

    torch.manual_seed(0)
    x = torch.randn(5, 64 * 37) * 4
    x[1, 100] = x[1, 2000] = 50.0  # a tie across chunks
    x[2, 7] = x[2, 8] = 50.0  # a tie inside a chunk
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x)[1] == 100 and argmax_rows(x)[2] == 7
    torch.testing.assert_close(logsumexp_rows(x), torch.logsumexp(x, -1))
    odd = torch.randn(3, 1001)  # a vocabulary that does not split into chunks
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))
    torch.testing.assert_close(logsumexp_rows(odd), torch.logsumexp(odd, -1))


def test_soft_capped_reductions_read_the_raw_head_for_their_maxima():
    """With a soft-cap the chunks' peaks and the greedy token come from the head's raw output (the cap is
    monotonic; one tanh an element instead of two): the same bits as the reductions over the capped
    logits, the same greedy tokens, and logprobs that match torch's log_softmax of the capped logits."""
    from flexgemma.engine.sampler import SamplingBatch, argmax_rows, logsumexp_rows, sample
    from flexgemma.model.glue import final_logits

    torch.manual_seed(0)
    head = (torch.randn(6, 64 * 37) * 40).bfloat16()  # raw values past the cap of 30
    head[1, 100] = head[1, 2000] = 180.0  # a tie across chunks, above every other value
    capped = final_logits(head, 30.0)
    assert torch.equal(logsumexp_rows(head, 30.0), logsumexp_rows(capped))
    b = head.shape[0]
    greedy = SamplingBatch(torch.zeros(b), torch.zeros(b, dtype=torch.long), torch.ones(b),
                           torch.arange(b), torch.full((b,), 5), needs_filter=False, greedy_only=True)
    tokens, lp = sample(head, greedy, softcap=30.0)
    assert torch.equal(tokens, capped.argmax(-1)) and tokens[1] == 100
    torch.testing.assert_close(lp, torch.log_softmax(capped, -1).gather(-1, tokens[:, None])[:, 0])
    assert torch.equal(argmax_rows(head), tokens)


@pytest.mark.gpu
def test_compiled_top_k_top_p_sampler_on_the_gpu():
    """The sorted filter path through torch.compile (dynamic shapes) on a 262k vocabulary: torch
    2.11's split scan crashed on a per-row operand inside the cumulative sum (pytorch#180221). The
    compiled sampler draws what the eager one draws."""
    from flexgemma.model.compiled import CompileCounter, compile_fn
    from flexgemma.engine.sampler import SamplingBatch, sample

    compiled = compile_fn(sample, CompileCounter())
    for rows in (5, 7, 64):
        g = torch.Generator(device="cuda").manual_seed(rows)
        logits = torch.randn(rows, 262144, device="cuda", generator=g) * 4
        ar = torch.arange(rows, device="cuda")
        batch = SamplingBatch(temperature=torch.ones(rows, device="cuda"), top_k=torch.where(ar % 2 == 0, 50, 0),
                              top_p=torch.where(ar % 3 == 0, 0.9, 1.0).float(), seed=ar, position=ar + 10,
                              needs_filter=True)
        tokens, logprobs = compiled(logits, batch)
        ref_tokens, ref_logprobs = sample(logits, batch)
        same = tokens == ref_tokens
        assert same.float().mean() >= 0.9
        assert torch.allclose(logprobs[same], ref_logprobs[same], atol=1e-4)


@pytest.mark.parametrize("kind", ["greedy", "sampled", "filtered"])
def test_the_sampler_caps_the_heads_output_as_the_model_does(kind):
    """The decode step hands the sampler the head's bf16 output and the model's soft-cap (the cap
    fuses into the sampler's reductions instead of a float32 copy of the logits): the same tokens
    and logprobs as sampling the model's own capped float32 logits."""
    from flexgemma.model.glue import final_logits

    g = torch.Generator().manual_seed(0)
    head = (torch.randn(6, 512, generator=g) * 40).bfloat16()  # past the cap of 30: tanh matters
    rows = torch.arange(6)
    filtered = kind == "filtered"
    batch = SamplingBatch(
        temperature=torch.full((6,), 0.0 if kind == "greedy" else 1.0), top_k=torch.full((6,), 20 if filtered else 0),
        top_p=torch.full((6,), 0.9 if filtered else 1.0), seed=rows + 7, position=rows + 100,
        needs_filter=filtered, greedy_only=kind == "greedy")
    tokens, logprobs = sample(head, batch, softcap=30.0)
    ref_tokens, ref_logprobs = sample(final_logits(head, 30.0), batch)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logprobs, ref_logprobs)
    uncapped = sample(head.float(), batch)[1]
    assert not torch.allclose(logprobs, uncapped)  # the cap was applied (it changes every logprob)
