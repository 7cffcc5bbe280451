"""task=determinism: run-to-run equality, batch invariance of seeded sampling, graphs vs eager."""

from __future__ import annotations

import dataclasses

from flexgemma.config.schema import Config


def run(engine, workload, cfg: Config, recorder) -> dict:
    def generate(prompts, params):
        # every run computes its prompts: a hit on an earlier run's pages (kv.prefix_cache) rounds
        # differently from computing them, which is not what run-to-run or batch invariance ask
        engine.reset_prefix_cache()
        return engine.generate(prompts, params)

    sampled = [dataclasses.replace(p, temperature=max(p.temperature, 1.0)) for p in workload.params]
    first = [o.token_ids for o in generate(workload.prompts, sampled)]
    second = [o.token_ids for o in generate(workload.prompts, sampled)]
    # batch invariance: a few requests alone, and in reverse order beside the others
    k = min(3, len(workload.prompts))
    alone = [generate([workload.prompts[i]], [sampled[i]])[0].token_ids for i in range(k)]
    rev = generate(workload.prompts[::-1], sampled[::-1])
    reversed_tokens = [o.token_ids for o in rev][::-1]
    summary = {
        "determinism/run_to_run": first == second,
        "determinism/batch_invariant": alone == first[:k] and reversed_tokens == first,
    }
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        greedy = [dataclasses.replace(p, temperature=0.0) for p in workload.params]
        with_graphs = [o.token_ids for o in generate(workload.prompts, greedy)]
        engine.runner.graphs = None
        try:
            eager = [o.token_ids for o in generate(workload.prompts, greedy)]
        finally:
            engine.runner.graphs = graphs
        summary["determinism/graphs_vs_eager"] = with_graphs == eager
    recorder.log_round(summary)
    return summary
