"""The sampler's empirical frequencies against the exact filtered, tempered softmax.

Draws are a pure function of (seed, position, token), so these frequencies are fixed numbers: the
bounds below hold for the real code with room to spare, and a sampler that scales by `* temp`, or
a top-k / top-p filter that keeps one candidate too many or too few, misses them by far (each
kept candidate carries at least ~7% of the kept mass)."""

import pytest
import torch

from flexgemma.engine.sampler import SamplingBatch, sample

V = 16
# distinct, well-separated logits (probabilities at T=1: 0.29, 0.18, 0.13, 0.10, ...)
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.6, 0.3, 0.1, -0.1, -0.3, -0.6, -0.8, -1.0, -1.3, -1.6, -2.0, -2.5])
PERM = torch.randperm(V, generator=torch.Generator().manual_seed(3))  # the best token is not token 0
N = 40_000  # draws: the total-variation noise is ~0.01
TV_BOUND = 0.03


def expected(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The reference, written independently of the sampler: softmax(logits / T), keep the k best,
    renormalise, keep the smallest prefix (by probability) whose mass before each member <= top_p."""
    logits = LOGITS[PERM]
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = sum(probs[t].item() for t in kept)
    keep, before = [], 0.0
    for t in kept:
        if before > top_p:
            break
        keep.append(t)
        before += probs[t].item() / mass
    out = torch.zeros(V, dtype=torch.float64)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def empirical(temperature: float, top_k: int = 0, top_p: float = 1.0, seed0: int = 0) -> torch.Tensor:
    logits = LOGITS[PERM].expand(N, -1)
    batch = SamplingBatch(
        temperature=torch.full((N,), temperature), top_k=torch.full((N,), top_k, dtype=torch.long),
        top_p=torch.full((N,), top_p), seed=torch.arange(N, dtype=torch.long) % 997 + seed0,
        position=torch.arange(N, dtype=torch.long) // 997 + 5, needs_filter=bool(top_k or top_p < 1))
    tokens, _ = sample(logits, batch)
    return torch.bincount(tokens, minlength=V).double() / N


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature):
    emp, exp = empirical(temperature), expected(temperature)
    assert tv(emp, exp) < TV_BOUND
    # the reference separates the alternatives: `logits * T` and T=1 are far from it
    assert tv(expected(1 / temperature), exp) > 3 * TV_BOUND or temperature == 1.0


@pytest.mark.parametrize("temperature,top_k", [(1.0, 3), (2.0, 5), (0.5, 2)])
def test_top_k_keeps_exactly_k_in_tempered_proportions(temperature, top_k):
    emp, exp = empirical(temperature, top_k=top_k), expected(temperature, top_k=top_k)
    assert int((emp > 0).sum()) == top_k
    assert tv(emp, exp) < TV_BOUND
    for wrong in (top_k - 1, top_k + 1):  # the bound tells k from k +- 1
        assert tv(expected(temperature, top_k=wrong), exp) > 2 * TV_BOUND


@pytest.mark.parametrize("temperature,top_p,kept", [(1.0, 0.5, 3), (2.0, 0.5, 5), (0.5, 0.8, 3)])
def test_top_p_keeps_the_nucleus_after_temperature(temperature, top_p, kept):
    exp = expected(temperature, top_p=top_p)
    assert int((exp > 0).sum()) == kept  # the fixture's boundary, checked so a changed fixture says so
    emp = empirical(temperature, top_p=top_p)
    assert int((emp > 0).sum()) == kept
    assert tv(emp, exp) < TV_BOUND
    # the nucleus of the untempered distribution is another set (top-p applies after temperature)
    if temperature != 1.0:
        assert tv(expected(1.0, top_p=top_p), exp) > 2 * TV_BOUND


def test_top_k_and_top_p_together():
    emp, exp = empirical(2.0, top_k=4, top_p=0.6), expected(2.0, top_k=4, top_p=0.6)
    assert tv(emp, exp) < TV_BOUND


def test_frequencies_do_not_depend_on_the_seed_offset():
    """Another block of seeds gives other draws with the same law."""
    a, b = empirical(1.0, seed0=0), empirical(1.0, seed0=100_000)
    assert not torch.equal(a, b) and tv(a, b) < TV_BOUND
