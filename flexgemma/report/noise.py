"""Which swept keys can explain a difference between jobs, and how large a difference is noise.

Two things make a sweep's ranking untrustworthy, and the verdict (tables.verdict) checks both:

- An inert key: the swept key was never read by the runs, so jobs that differ only in it are
  repeats of one configuration. Whether a key is read is known from what each job recorded in its
  summary.json (the engine's build facts, `engine/...`), through the explicit table INERT_RULES
  below: e.g. `attn.decode.block_n` is a flex kernel option, and a job whose recorded
  `engine/attention_backend` is `dense` (the CPU default) never passes it to any kernel. We keep
  a table rather than recording every key the engine reads: the few keys that can be inert are
  the backend-specific ones, and the table says why in words the report can show.
- Repeats: jobs that differ only in a repeat key (`seed`, or a `+repeat=N` axis added for this
  purpose) or in inert keys measure the same configuration several times. The largest relative
  spread of their median tokens/s is the run-to-run noise; a difference between configurations
  smaller than that is "within noise".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from flexgemma.report.collect import MISSING, Collection, Job

OUTPUT = "throughput/output_tok_s_median"

# Keys that only name a repetition: `seed` is the engine's sampling seed (requests of the bench
# workload carry their own seeds, workload.seed), `repeat` a key added only to repeat jobs.
REPEAT_KEYS = ("seed", "repeat")


@dataclass(frozen=True)
class InertRule:
    """Keys starting with `prefix` are read only when `is_read(summary)` is true. `why(summary)`
    says, for a job where they are not read, what it recorded that shows it."""

    prefix: str
    summary_key: str  # the recorded fact the rule looks at; a job without it tells nothing
    is_read: Callable[[Any], bool]
    why: Callable[[Any], str]
    absent_means_unread: bool = False  # the builder records the fact only where the key is read


def _moe_unread(moe_kernel) -> str:
    return f"the routed experts ran {moe_kernel}" if moe_kernel else "the model has no MoE layers"


# The backend-specific keys (builder.py decides each from these same facts).
INERT_RULES = (
    # flex kernel options reach flex_attention only through the compiled `flex` backend: `dense`
    # (SDPA over the listed pages) and `flex_eager` (torch's reference) take no kernel options
    InertRule("attn.decode.", "engine/attention_backend", lambda v: v == "flex",
              lambda v: f"the attention backend was {v}, which takes no flex kernel options"),
    InertRule("attn.prefill.", "engine/attention_backend", lambda v: v == "flex",
              lambda v: f"the attention backend was {v}, which takes no flex kernel options"),
    # only the flex kernels read a mask's full blocks apart; the other backends evaluate the mask_mod
    InertRule("kernels.prefill_full_blocks", "engine/attention_backend", lambda v: v == "flex",
              lambda v: f"the attention backend was {v}, which evaluates the mask on every listed page"),
    # the invariant kernels' chunks and tiles are read only under engine.batch_invariant (backend `invariant`)
    InertRule("kernels.invariant_", "engine/attention_backend", lambda v: v == "invariant",
              lambda v: f"the attention backend was {v}: engine.batch_invariant was off"),
    # CUDA graphs are captured only on a GPU with cudagraph.enabled
    InertRule("cudagraph", "engine/cudagraphs", lambda v: v is True,
              lambda v: "no CUDA graphs were captured (a CPU run, or cudagraph=off)"),
    # the routed kernels' thresholds (and the prefill path's dequantise choice) reach a kernel only
    # when the Triton expert kernels run; the 4-bit groups' ones only with the Triton 4-bit groups
    *(InertRule(f"kernels.{key}", "engine/moe_kernel", lambda v: v == "triton", _moe_unread,
                absent_means_unread=True)
      for key in ("moe_sort_above", "moe_fused_max_entries", "moe_dequant")),
    InertRule("kernels.linear4bit_", "engine/linear4bit_kernel", lambda v: v == "triton",
              lambda v: f"the 4-bit projections ran {v}" if v else "the model is not 4-bit (quant=bf16)",
              absent_means_unread=True),
    # recorded only for models with MoE layers / 4-bit builds (builder.py)
    InertRule("kernels.moe", "engine/moe_kernel", lambda v: v is not None,
              lambda v: "the model has no MoE layers", absent_means_unread=True),
    InertRule("kernels.linear4bit", "engine/linear4bit_kernel", lambda v: v is not None,
              lambda v: "the model is not 4-bit (quant=bf16)", absent_means_unread=True),
)


def _rule_for(key: str) -> InertRule | None:
    for rule in INERT_RULES:
        if key == rule.prefix.rstrip(".") or key.startswith(rule.prefix):
            return rule
    return None


def inert_keys(coll: Collection) -> dict[str, str]:
    """Swept key -> why it had no effect, for the keys no job read. A key counts as inert only when
    every job that recorded the deciding fact shows it unread (and at least one job did)."""
    out = {}
    for key in coll.swept_keys:
        rule = _rule_for(key)
        if rule is None:
            continue
        if rule.absent_means_unread:  # only finished jobs recorded their build facts
            facts = [j.summary.get(rule.summary_key) for j in coll.jobs if j.ok]
        else:
            facts = [j.summary[rule.summary_key] for j in coll.jobs if rule.summary_key in j.summary]
        if facts and not any(rule.is_read(v) for v in facts):
            out[key] = rule.why(facts[0])
    return out


def repeat_keys(coll: Collection) -> list[str]:
    return [k for k in coll.swept_keys if k.lstrip("+") in REPEAT_KEYS]


def live_keys(coll: Collection, inert: dict[str, str]) -> list[str]:
    """The swept keys that can explain a difference: neither inert nor a repeat axis."""
    repeats = repeat_keys(coll)
    return [k for k in coll.swept_keys if k not in inert and k not in repeats]


@dataclass
class Group:
    """The ok jobs of one configuration (equal in every live key), ordered fastest first."""

    values: dict[str, str]  # live key -> value
    jobs: list[Job]

    @property
    def medians(self) -> list[float]:
        return [float(j.get(OUTPUT)) for j in self.jobs]

    @property
    def total(self) -> float:
        """The configuration's output tokens/s: the median over its jobs' medians."""
        return statistics.median(self.medians)

    @property
    def spread(self) -> float | None:
        """(max - min) / median of its jobs' medians; None for a single job."""
        m = self.medians
        return (max(m) - min(m)) / statistics.median(m) if len(m) > 1 else None


def groups(coll: Collection, live: list[str]) -> list[Group]:
    """The ok jobs with a output tokens/s, grouped by their live swept values, fastest group first."""
    by_values: dict[tuple, Group] = {}
    for job in coll.ok_jobs:
        if not isinstance(job.get(OUTPUT), (int, float)):
            continue
        values = {k: job.swept.get(k, MISSING) for k in live}
        by_values.setdefault(tuple(values.values()), Group(values, [])).jobs.append(job)
    out = sorted(by_values.values(), key=lambda g: -g.total)
    for g in out:
        g.jobs.sort(key=lambda j: -j.get(OUTPUT))
    return out


def noise(gs: list[Group]) -> tuple[float, int] | None:
    """(the largest relative spread among repeated configurations, how many jobs measured it), or
    None when no configuration ran more than once. The largest, not the mean: a verdict should
    hold against the worst repeat seen."""
    spreads = [(g.spread, len(g.jobs)) for g in gs if g.spread is not None]
    if not spreads:
        return None
    return max(s for s, _ in spreads), sum(n for _, n in spreads)
