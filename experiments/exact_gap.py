"""Where the engine and the trainer's forward part on a GRPO-shaped rollout (a probe, not a test).

`task=grpo engine.batch_invariant=true task.trainer_forward=engine` should give |dlogp| = 0; this
rebuilds one of its steps piece by piece and says, per piece, whether the logprobs are bitwise the
rollout's and where they first part:

  score        engine.score() of every finished sequence (teacher-forced prefill vs decode)
  alone        the group's first and second member generated alone (batch and prefix-cache tail copy)
  no_prefix    the same rollout with kv.prefix_cache=false (each member prefills its own prompt)
  eager        the same rollout with cudagraph.enabled=false
  trainer      model.trainable.TrainableForward over micro-batches of --micro sequences (the job's)
  trainer_one  the trainer's forward one sequence at a time
  compiles     graphs torch.compile made for the trainer (0: it runs the glue the engine compiled)
  trace        (--trace) the first sequence's glue calls, engine.score() vs the trainer, call by call:
               the first call whose inputs or output part (names the op between or the glue itself)

The rollout is the job's: --prompts prompts of 64-128 random tokens, each --group times with its own
seed, --new tokens at temperature 1, the LoRA factors upcast to float32 as task=grpo holds them.

    python experiments/exact_gap.py +model=e2b lora=r32 device=cuda
    python experiments/exact_gap.py +model=26b_a4b quant=bnb4 lora=r16 device=cuda --micro 8
    python experiments/exact_gap.py +model=tiny lora=r16 device=cpu --prompts 2 --group 4 --new 24  # CPU check
"""

from __future__ import annotations

import argparse
import time

import torch


def parts(name: str, got: list, want: list) -> bool:
    """Prints whether got (per sequence logprobs) equals want bit for bit, else the first parting."""
    total = sum(len(w) for w in want)
    same = sum(int(a == b) for g, w in zip(got, want) for a, b in zip(list(g), list(w)))
    first = next(((i, t, g[t], w[t]) for i, (g, w) in enumerate(zip(got, want))
                  for t in range(min(len(g), len(w))) if g[t] != w[t]), None)
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(list(g), list(w))]
    lengths = all(len(g) == len(w) for g, w in zip(got, want))
    verdict = "EQUAL" if first is None and lengths else "PARTS"
    where = "" if first is None else (f"; first at sequence {first[0]} token {first[1]}: {first[2]!r} vs {first[3]!r}"
                                      f"; mean |d| {sum(diffs) / max(len(diffs), 1):.4g}, max {max(diffs):.4g}")
    print(f"{name:12s} {verdict}  {same}/{total} tokens equal{'' if lengths else ', lengths differ'}{where}", flush=True)
    return verdict == "EQUAL"


def grpo_engine(overrides: list[str], demand: tuple[int, int]):
    """The engine and the task=grpo job's view of it (SharedModel: float32 factors, merged weights)."""
    from flexgemma import build_engine, compose
    from flexgemma.engine.kv_cache import PoolDemand
    from flexgemma.rl.shared import SharedModel

    t0 = time.perf_counter()
    eng = build_engine(compose(overrides), PoolDemand(*demand))
    shared = SharedModel(eng, engine_forward=True)
    eng.update_lora(shared.peft_model)
    print(f"# engine {' '.join(overrides)} built in {time.perf_counter() - t0:.0f} s", flush=True)
    return eng, shared


def grpo_rollout(eng, n_prompts: int, group: int, new: int):
    """The job's rollout: n_prompts random prompts of 64-128 tokens, each `group` times with its own
    seed, `new` tokens at temperature 1. Returns (prompts, params, outputs)."""
    from flexgemma import SamplingParams

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, min(30000, eng.spec.vocab_size), (int(n),), generator=g).tolist()
           for n in torch.randint(64, 129, (n_prompts,), generator=g)]
    prompts = [p for p in ids for _ in range(group)]
    params = [SamplingParams(max_new_tokens=new, temperature=1.0, seed=1000 + i) for i in range(len(prompts))]
    return prompts, params, eng.generate(prompts, params, strict=True)


def trace(eng, shared, seq: list, first: int) -> None:
    """Records every glue call (name, row inputs, output) of engine.score([seq]) and of the trainer's
    forward of seq, and prints the first call where the two part."""
    from flexgemma.model import glue
    from flexgemma.model.trainable import TrainableForward

    ops = eng.runner.forward.ops
    calls: list = []

    def recorder(name, fn):
        def call(*args):
            out = fn(*args)
            outs = out if isinstance(out, tuple) else (out,)
            calls.append((name, [args[i].detach().clone() for i in glue.ROW_ARGS[name]],
                          [o.detach().clone() for o in outs if torch.is_tensor(o)]))
            return out
        return call

    originals = {n: getattr(ops, n) for n in glue.ROW_ARGS}
    for n, fn in originals.items():
        setattr(ops, n, recorder(n, fn))
    try:
        eng.score([seq], [first])
        engine_calls, calls[:] = list(calls), []
        tf = TrainableForward(eng.runner.forward, eng.lora)
        shared.merged_for_training()
        with torch.no_grad():
            tf.token_logprobs([seq], [first])
        trainer_calls = list(calls)
    finally:
        for n, fn in originals.items():
            setattr(ops, n, fn)
    print(f"{'trace':12s} engine {len(engine_calls)} glue calls, trainer {len(trainer_calls)}", flush=True)

    def common(a, b):  # the rows both hold (the CPU engine pads its rows)
        n = min(a.shape[0], b.shape[0]) if a.dim() and b.dim() else None
        return (a, b) if n is None or a.shape[1:] != b.shape[1:] else (a[:n], b[:n])

    def same(a, b):
        a, b = common(a, b)
        return a.shape == b.shape and torch.equal(a, b)

    for i, ((n1, in1, out1), (n2, in2, out2)) in enumerate(zip(engine_calls, trainer_calls)):
        if n1 != n2:
            print(f"{'trace':12s} call {i}: engine {n1}, trainer {n2}", flush=True)
            return
        bad_in = [j for j, (x, y) in enumerate(zip(in1, in2)) if not same(x, y)]
        bad_out = [j for j, (x, y) in enumerate(zip(out1, out2)) if not same(x, y)]
        if bad_in or bad_out:
            def d(x, y):
                x, y = common(x, y)
                return (f"{tuple(x.shape)} {x.dtype} {x.stride()} vs {tuple(y.shape)} {y.dtype} {y.stride()}"
                        if x.shape != y.shape else f"max |d| {(x.float() - y.float()).abs().max().item():.3g}, "
                        f"{int((x != y).reshape(x.shape[0], -1).any(-1).sum())}/{x.shape[0]} rows differ")
            what = (f"inputs {bad_in} part ({d(in1[bad_in[0]], in2[bad_in[0]])}): the op before it"
                    if bad_in else f"same inputs, outputs {bad_out} part ({d(out1[bad_out[0]], out2[bad_out[0]])}): "
                    f"the glue itself")
            print(f"{'trace':12s} call {i} ({n1}): {what}", flush=True)
            for j, x in enumerate(in1):
                print(f"{'':12s}   input {j}: engine {x.dtype} {tuple(x.shape)} {x.stride()}, "
                      f"trainer {in2[j].dtype} {tuple(in2[j].shape)} {in2[j].stride()}", flush=True)
            return
    print(f"{'trace':12s} the common {min(len(engine_calls), len(trainer_calls))} calls agree bit for bit", flush=True)


def grpo_step_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a GRPO-shaped step: the engine's overrides and the rollout's shape."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides of the engine (model, quant, lora, device)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16, help="sequences per trainer forward (task.micro_batch)")
    return ap


def main() -> None:
    ap = grpo_step_parser(__doc__)
    ap.add_argument("--skip", default="", help="comma-separated pieces to leave out")
    ap.add_argument("--trace", action="store_true", help="compare the first sequence's glue calls one by one")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))

    from flexgemma.model.trainable import TrainableForward

    base = [*a.overrides, "engine.batch_invariant=true"]
    demand = (a.prompts * a.group, 128 + a.new)
    eng, shared = grpo_engine(base, demand)
    prompts, params, outs = grpo_rollout(eng, a.prompts, a.group, a.new)
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    firsts = [len(p) for p in prompts]
    want = [o.logprobs for o in outs]
    print(f"# rollout: {len(outs)} sequences, {sum(len(w) for w in want)} tokens", flush=True)

    if "score" not in skip:
        parts("score", [s.logprobs for s in eng.score(seqs, firsts)], want)
    if "alone" not in skip:
        alone = [eng.generate([prompts[i]], [params[i]])[0].logprobs for i in (0, 1)]
        parts("alone", alone, want[:2])
    if "trainer" not in skip or "trainer_one" not in skip:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        tf = TrainableForward(eng.runner.forward, eng.lora)
        shared.merged_for_training()
        with torch.no_grad():
            if "trainer" not in skip:
                got = []
                for i in range(0, len(seqs), a.micro):
                    got += [t.tolist() for t in tf.token_logprobs(seqs[i: i + a.micro], firsts[i: i + a.micro])[0]]
                parts("trainer", got, want)
            if "trainer_one" not in skip:
                n = min(4, len(seqs))
                got = [tf.token_logprobs([seqs[i]], [firsts[i]])[0][0].tolist() for i in range(n)]
                parts("trainer_one", got, want[:n])
        # the trainer must run the glue the engine compiled (a second compile may reduce rows otherwise)
        print(f"{'compiles':12s} {counters['stats']['unique_graphs'] - graphs} new graphs in the trainer", flush=True)
    if a.trace:
        trace(eng, shared, seqs[0], firsts[0])
    for name, extra in (("no_prefix", "kv.prefix_cache=false"), ("eager", "cudagraph.enabled=false")):
        if name in skip:
            continue
        del eng, shared
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eng, shared = grpo_engine([*base, extra], demand)
        parts(name, [o.logprobs for o in eng.generate(prompts, params)], want)


if __name__ == "__main__":
    main()
