"""Does the CPU suite notice small, plausible bugs? Applies each mutation below to a copy of the
checkout, runs the tests that should catch it there, and prints mutation -> caught (by which test)
or MISSED. Not part of the default test run (CPU only, about 10 minutes); run it after changing the
code a mutation names, or the tests that catch it. tests/test_experiments.py checks on every CI run
that each mutation's text still occurs exactly once in the code, so the script cannot rot unseen:

    OMP_WAIT_POLICY=PASSIVE python experiments/mutation_check.py [-k NAME_SUBSTRING]

Exit code 1 if a mutation is missed (or the unmutated copy fails its tests).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ("flexgemma", "tests", "conf", "hydra_plugins", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # inside the checkout
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, -k ...)


MUTATIONS = [
    # the six of issue 23
    Mutation("temperature as logits * temp", "flexgemma/engine/sampler.py",
             "scaled = capped / temp", "scaled = capped * temp", ("tests/engine/test_sampling_exact.py",)),
    Mutation("prefill draw position without the chunk offset", "flexgemma/engine/runner.py",
             "draw_pos.append(p0 + n)", "draw_pos.append(n)", ("tests/engine/test_seeds.py",)),
    Mutation("unseeded requests ignore the request number", "flexgemma/engine/engine.py",
             "(self.seed * 1_000_003 + rid)", "(self.seed * 1_000_003)", ("tests/engine/test_seeds.py",)),
    Mutation("position dropped from the seed hash (engine-level tests only)", "flexgemma/engine/sampler.py",
             "key = _mix((seeds.long() & _MASK31) ^ _mix((positions.long() * 0x27D4EB2F) & _MASK31))",
             "key = _mix(seeds.long() & _MASK31)", ("tests/engine/test_seeds.py",)),
    Mutation("html.escape removed from the HTML report", "flexgemma/report/render.py",
             "return html.escape(str(text))", "return str(text)", ("tests/report/test_report_verdicts.py",)),
    Mutation("noise-overlap comparison inverted", "flexgemma/report/tables.py",
             "if b and r and r[2] >= b[0]:", "if b and r and r[2] < b[0]:", ("tests/report/test_report_verdicts.py",)),
    # a few more of the same kind
    Mutation("uniforms unclamped (1.0 for the top hashes: an infinite Gumbel noise)", "flexgemma/engine/sampler.py",
             "return torch.clamp_max(((h & _MASK31).float() + 0.5) * (1.0 / 2147483648.0), 1.0 - 2.0 ** -24)",
             "return ((h & _MASK31).float() + 0.5) * (1.0 / 2147483648.0)", ("tests/engine/test_sampling.py",)),
    Mutation("top-k keeps k+1 candidates", "flexgemma/engine/sampler.py",
             "drop = (rank >= k) |", "drop = (rank > k) |", ("tests/engine/test_sampling_exact.py",)),
    Mutation("top-p drops the candidate that crosses p", "flexgemma/engine/sampler.py",
             "(mass - sorted_probs > top_p", "(mass > top_p",
             ("tests/engine/test_sampling_exact.py",)),
    Mutation("top-k/top-p on the untempered logits", "flexgemma/engine/sampler.py",
             "scaled = _filter_top_k_top_p(scaled, p.top_k, p.top_p)",
             "scaled = _filter_top_k_top_p(capped, p.top_k, p.top_p)", ("tests/engine/test_sampling_exact.py",)),
    Mutation("decode draw position off by one", "flexgemma/engine/runner.py",
             "batch = SamplingBatch(temperature, top_k, top_p, seed, positions + 1,",
             "batch = SamplingBatch(temperature, top_k, top_p, seed, positions,", ("tests/engine/test_seeds.py",)),
    Mutation("x the slowest divides by the fastest other job", "flexgemma/report/tables.py",
             "{top.total / gs[-1].total:.2f}× the slowest", "{top.total / gs[1].total:.2f}× the slowest",
             ("tests/report/test_report_verdicts.py",)),
    Mutation("runner-up gap relative to the runner-up", "flexgemma/report/tables.py",
             "gap = 100 * (top.total - runner.total) / top.total",
             "gap = 100 * (top.total - runner.total) / runner.total", ("tests/report/test_report_verdicts.py",)),
    Mutation("LoRA merge scale 5% high", "flexgemma/model/lora.py",
             "merge_into(self.weight, self.pristine, lhs.to(self.weight.dtype), rhs.to(self.weight.dtype), scale)",
             "merge_into(self.weight, self.pristine, lhs.to(self.weight.dtype), rhs.to(self.weight.dtype), scale * 1.05)",
             ("tests/model/test_lora.py", "-k", "merged_weights_are_pristine")),
    Mutation("big-model refusal suggests the wrong small variant", "flexgemma/model/estimate.py",
             'small = "tiny_moe (the same MoE architecture" if est.moe else', 'small = "tiny_moe (the same MoE architecture" if not est.moe else',
             ("tests/model/test_estimate.py",)),
    # issue 36: the weights the engine runs, GRPO, and behaviours pinned by tests/test_regressions.py
    Mutation("a replaced parameter is not copied into the storage the forward reads", "flexgemma/model/watch.py",
             "                e.run.copy_(cur.detach())", "                pass",
             ("tests/model/test_weights.py", "-k", "replaced_or_data_changed")),
    Mutation("an interrupted update_lora keeps the half-merged adapter", "flexgemma/model/lora.py",
             "            self._restore(dst, previous)\n", "",
             ("tests/model/test_weights.py", "-k", "interrupted_at_the_kth")),
    Mutation("a preempted request queues behind later arrivals", "flexgemma/engine/scheduler.py",
             "self.waiting.appendleft(seq)", "self.waiting.append(seq)",
             ("tests/test_regressions.py", "-k", "preempted")),
    Mutation("the rollout seed does not move with the step", "flexgemma/rl/rollout.py",
             "        self.calls += 1\n", "",
             ("tests/test_regressions.py", "-k", "two_rollouts")),
    Mutation("IS ratio exp(engine - trainer)", "flexgemma/rl/rollout.py",
             "log_r = torch.nan_to_num((trainer_lp - engine_lp).float()",
             "log_r = torch.nan_to_num((engine_lp - trainer_lp).float()",
             ("tests/test_regressions.py", "-k", "is_correction")),
    Mutation("sleep() keeps the prefix cache", "flexgemma/engine/engine.py",
             "            self.reset_prefix_cache()  # the pool's contents are lost",
             "            pass  # the pool's contents are lost",
             ("tests/test_regressions.py", "-k", "sleep_then_wake")),
]


def copy_checkout(dst: Path) -> None:
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst / name)


def run_tests(where: Path, args: tuple[str, ...]) -> tuple[bool, str]:
    """(passed, the first failing test's id or the tail of the output)."""
    env = {**os.environ, "PYTHONPATH": str(where), "OMP_WAIT_POLICY": "PASSIVE"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *args],
                       cwd=where, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode == 0:
        return True, ""
    failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M)
    return False, failed[0] if failed else (r.stdout + r.stderr)[-400:]


def check(m: Mutation, base: Path) -> tuple[bool, str, float]:
    """(caught, by which test, seconds) for one mutation, in a fresh copy of `base`."""
    with tempfile.TemporaryDirectory(prefix="flexgemma-mutant-") as tmp:
        work = Path(tmp)
        for name in COPY:
            src = base / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, work / name)
        f = work / m.path
        text = f.read_text()
        if text.count(m.old) != 1:
            raise SystemExit(f"mutation {m.name!r}: {m.old!r} occurs {text.count(m.old)} times in {m.path} "
                             "(the code changed: update the mutation)")
        f.write_text(text.replace(m.old, m.new))
        t0 = time.perf_counter()
        passed, test = run_tests(work, m.tests)
        return not passed, test, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    with tempfile.TemporaryDirectory(prefix="flexgemma-base-") as tmp:
        base = Path(tmp)
        copy_checkout(base)
        for tests in dict.fromkeys(m.tests for m in chosen):  # each selection once, in order
            ok, why = run_tests(base, tests)
            if not ok:
                print(f"the unmutated copy fails {' '.join(tests)} ({why}): fix that first", file=sys.stderr)
                return 1
        rows, missed = [], 0
        for m in chosen:
            caught, test, secs = check(m, base)
            missed += not caught
            rows.append((m.name, f"caught by {test.removeprefix('tests/')}" if caught else "MISSED", f"{secs:.0f} s"))
            print(f"{m.name}: {rows[-1][1]} ({rows[-1][2]})", file=sys.stderr, flush=True)
    print("| mutation | result | time |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
