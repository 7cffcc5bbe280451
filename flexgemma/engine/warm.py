"""Nothing compiles, autotunes or allocates lazily inside a timed round.

`warm_up` runs at build time (engine.warmup) what a workload will run: every decode bucket's graphs
replayed once (or an eager decode step per attention row count), then one generate() over prompts
shaped like the workload's (as many sequences as it runs at once, lengths up to its longest, so
prefill steps of engine.max_prefill_tokens and a partial one; greedy, sampled and top-k rows, so
every sampler variant compiles), then one-row and all-greedy generate() calls (the shapes a round of
another size adds). The engine's request ids, counters and prefix cache are left as they were.

`RoundWatch` brackets each timed round: compiled graphs (the engine's counter and dynamo's) and the
allocator's reserved bytes before and after; a round in which either grew is reported and warned
about, since its time includes the compile or the allocation.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from flexgemma.engine.kv_cache import PoolDemand
from flexgemma.engine.sequence import SamplingParams
from flexgemma.model.compiled import dynamo_graphs

log = logging.getLogger("flexgemma")

WARM_NEW_TOKENS = 2  # one prefill sample and one decode step of each warm-up request


def compiled_graphs(engine) -> int:
    """Graphs torch.compile has built so far: the engine's own counter, or dynamo's count of unique
    graphs in this process where that is larger (a compile outside the engine's counter)."""
    own = engine.compile_counter.count if getattr(engine, "compile_counter", None) is not None else 0
    return max(own, dynamo_graphs())


def _reserved(engine) -> int:
    return torch.cuda.memory_reserved() if engine.runner.device.type == "cuda" else 0


def warm_prompts(n: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of random ordinary tokens, lengths uniform in [1, longest], the first `longest`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=n)
    lengths[0] = longest
    return [rng.integers(3, vocab, size=int(length)).tolist() for length in lengths]


def warm_params(n: int) -> list[SamplingParams]:
    """Greedy and sampled rows alternating, one with top-k and top-p (the sorted filter path)."""
    params = []
    for i in range(n):
        filtered = i == 1
        params.append(SamplingParams(max_new_tokens=WARM_NEW_TOKENS, temperature=0.0 if i % 2 == 0 else 1.0,
                                     top_k=50 if filtered else 0, top_p=0.9 if filtered else 1.0, seed=i,
                                     ignore_eos=True))
    return params


@torch.inference_mode()
def eager_decode_steps(runner) -> None:
    """An empty eager decode step at every row count decode attention runs at (flex: its compiled
    shapes), or at the runner's largest batch where attention takes any count (the compiled glue)."""
    for rows in runner.kernels.decode_rows or [runner.max_batch]:
        runner.fill_decode([], rows)
        runner.decode_step(rows)


@torch.inference_mode()
def _warm_decode(runner) -> None:
    if runner.graphs is not None:
        g = runner.graphs
        for rows in g.buckets:
            for greedy in (False, True):
                runner.fill_decode([], rows)
                g.replay(rows, 0, greedy)
        g.hits.clear()
        g.padded_rows = g.real_rows = 0
    else:
        eager_decode_steps(runner)


def warm_up(engine, demand: PoolDemand = PoolDemand(), max_prefill_tokens: int = 8192, seed: int = 0) -> dict:
    """Runs the decode buckets and a workload-shaped generate() once; returns build-info entries
    (warmup_seconds, warmup_compiled_graphs: graphs compiled by it, compiled_graphs: the total)."""
    from flexgemma.engine.engine import StepStats

    t0 = time.perf_counter()
    before = compiled_graphs(engine)
    runner = engine.runner
    _warm_decode(runner)
    n = min(runner.max_batch, demand.seqs or runner.max_batch)
    # demand.tokens is prompt + new tokens, so an upper bound of the prompts; without it, one full prefill step
    longest = max(1, min(engine.max_model_len - 1 - WARM_NEW_TOKENS, demand.tokens or max_prefill_tokens))
    first_id = engine._next_id
    engine.generate(warm_prompts(n, longest, engine.spec.vocab_size, seed), warm_params(n), strict=True)
    # what a round of another size or sampling adds: steps that sample one row (size-1
    # specialisations) and steps whose rows are all greedy (the sampler's greedy-only variant)
    for k, temperature in ((1, 0.0), (1, 1.0), (min(n, 3), 0.0), (min(n, 3), 1.0)):
        engine.generate(warm_prompts(k, min(longest, 64), engine.spec.vocab_size, seed + 1),
                        SamplingParams(max_new_tokens=WARM_NEW_TOKENS, temperature=temperature, seed=seed,
                                       ignore_eos=True), strict=True)
    engine.reset_prefix_cache()  # the warm-up's prompts are nobody's prefix
    engine._next_id = first_id  # later requests draw the default seeds they would have drawn without warm-up
    engine.stats = StepStats()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return {"warmup_seconds": time.perf_counter() - t0, "warmup_compiled_graphs": compiled_graphs(engine) - before,
            "compiled_graphs": compiled_graphs(engine)}


class RoundWatch:
    """start() before a timed round, stop() after: what compiled or was allocated inside it."""

    def __init__(self, engine):
        self.engine = engine
        self.graphs = self.reserved = 0

    def start(self) -> None:
        self.graphs, self.reserved = compiled_graphs(self.engine), _reserved(self.engine)

    def stop(self, label: str = "timed round") -> dict:
        grew = compiled_graphs(self.engine) - self.graphs
        alloc = _reserved(self.engine) - self.reserved
        if grew or alloc > 0:
            log.warning("%s: %d graphs compiled and %.3f GiB more reserved inside it: its time includes them "
                        "(engine.warmup=true warms the buckets and prefill shapes before timing)", label, grew,
                        alloc / 2**30)
        return {"bench/compiled_in_round": grew, "bench/reserved_growth_gib": alloc / 2**30}
