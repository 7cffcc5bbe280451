"""Where the trainer's time goes with task.trainer_forward=engine (a probe, not a test).

Rebuilds one task=grpo step's training work (experiments/exact_gap.py's rollout: --prompts x --group
completions of --new tokens) and times the trainer's forward + backward over its micro-batches, no
optimizer, side by side in one process:

  engine            the engine's forward (model/trainable.py), layers recomputed in the backward, the kernels
                    config's trainer_* keys as given (the defaults: glue backward compiled on a GPU, bf16 maths)
  engine_keep       the same with task.gradient_checkpointing=false (each op's inputs kept)
  engine_reference  engine with the backward's references: kernels.trainer_glue_backward=eager and
                    kernels.trainer_backward_dtype=float32 (the glue op by op, attention and experts in float32)
  engine_eager_glue engine with kernels.trainer_glue_backward=eager alone
  engine_float32    engine with kernels.trainer_backward_dtype=float32 alone
  engine_torch_recompute  engine with kernels.trainer_recompute=reference (dense layers recomputed by torch's
                    products and the references' maths in the backward)
  transformers      transformers' Gemma-4 over peft's live adapters, full-vocabulary logits (the default trainer)

Medians of --rounds, peak memory of each; then one micro-batch of each --profile variant under
torch.profiler: GPU time per trainer op (the record_function scopes trainer.engine.* / trainer.backward.*:
the engine's kernels in the forward, the references' maths in the backward) and the top kernels.

    python experiments/profile_trainer.py +model=e2b lora=r32 device=cuda --micro 16
    python experiments/profile_trainer.py +model=26b_a4b quant=bnb4 lora=r16 device=cuda --prompts 4 --micro 8
    python experiments/profile_trainer.py +model=tiny lora=r16 device=cpu --prompts 2 --group 4 --new 16 --micro 4
"""

from __future__ import annotations

import statistics
import time

import torch

from exact_gap import grpo_engine, grpo_rollout, grpo_step_parser


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_step(tf, shared, batches, weights) -> None:
    """Forward and backward of every micro-batch through the engine's forward."""
    shared.merged_for_training()
    for (seqs, firsts), w in zip(batches, weights):
        lps, _ = tf.token_logprobs(seqs, firsts)
        sum((lp * wi).sum() for lp, wi in zip(lps, w)).backward()


def transformers_step(model, batches, weights, device) -> None:
    """The same through transformers' forward (right-padded micro-batches, as TRL pads them)."""
    for (seqs, firsts), w in zip(batches, weights):
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        total = 0.0
        for i, (s, f0) in enumerate(zip(seqs, firsts)):
            lp = torch.log_softmax(logits[i, f0 - 1: len(s) - 1].float(), -1).gather(-1, ids[i, f0: len(s), None])[:, 0]
            total = total + (lp * w[i]).sum()
        total.backward()


def timed(name: str, step, rounds: int, params) -> None:
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(rounds + 1):  # the first round warms up
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    print(f"{name:17s} forward+backward {statistics.median(times[1:]):.3f} s (median of {rounds}; rounds "
          f"{', '.join(f'{t:.3f}' for t in times[1:])}), peak {peak:.2f} GiB", flush=True)


def profile(name: str, tf, shared, batch, weights) -> None:
    """One micro-batch of the engine's forward under torch.profiler: time per trainer scope, top kernels."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine_step(tf, shared, [batch], [weights])  # warm
    _sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        engine_step(tf, shared, [batch], [weights])
        _sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)))

    def self_device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    # a record_function scope is two events under one key: the host range and its GPU annotation (whose
    # own "self" device time is the range, not kernels): one row per scope, kept out of the kernel sums
    scopes: dict[str, list] = {}
    for e in events:
        if e.key.startswith("trainer."):
            row = scopes.setdefault(e.key, [0, 0.0, 0.0])
            row[0] = max(row[0], e.count)
            row[1] = max(row[1], device_us(e) / 1e6)
            row[2] = max(row[2], e.cpu_time_total / 1e6)
    kernel_events = [e for e in events if not e.key.startswith("trainer.") and self_device_us(e) > 0]
    kernels = sum(self_device_us(e) for e in kernel_events) / 1e6
    print(f"# profile of {name}, one micro-batch ({len(batch[0])} sequences): wall {wall:.3f} s (profiled), GPU kernels "
          f"{kernels:.3f} s", flush=True)
    print(f"{'scope':34s} {'calls':>6s} {'GPU s':>8s} {'CPU s':>8s}")
    for key, (count, gpu_s, cpu_s) in sorted(scopes.items(), key=lambda kv: kv[1][1], reverse=True):
        print(f"{key:34s} {count:6d} {gpu_s:8.3f} {cpu_s:8.3f}")
    print("# top kernels by GPU time")
    for e in sorted(kernel_events, key=self_device_us, reverse=True)[:15]:
        print(f"  {self_device_us(e) / 1e6:8.3f} s {e.count:6d}x  {e.key[:110]}")


# variant -> (layers recomputed in the backward, the kernels.trainer_* keys it sets over the config's)
REFERENCE = {"trainer_glue_backward": "eager", "trainer_backward_dtype": "float32"}
VARIANTS = {"engine": (True, {}), "engine_keep": (False, {}), "engine_reference": (True, REFERENCE),
            "engine_eager_glue": (True, {"trainer_glue_backward": "eager"}),
            "engine_float32": (True, {"trainer_backward_dtype": "float32"}),
            "engine_torch_recompute": (True, {"trainer_recompute": "reference"})}


def main() -> None:
    ap = grpo_step_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out (engine_keep, engine_reference, "
                                               "engine_eager_glue, engine_float32, engine_torch_recompute, transformers)")
    ap.add_argument("--profile", default="engine,engine_reference",
                    help="variants to profile (comma-separated; none: '')")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))

    import dataclasses

    from flexgemma.model.trainable import TrainableForward

    eng, shared = grpo_engine([*a.overrides, "engine.batch_invariant=true"], (a.prompts * a.group, 128 + a.new))
    prompts, _, outs = grpo_rollout(eng, a.prompts, a.group, a.new)
    seqs, firsts = [p + o.token_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    batches = [(seqs[i: i + a.micro], firsts[i: i + a.micro]) for i in range(0, len(seqs), a.micro)]
    g = torch.Generator().manual_seed(1)
    device = eng.model.model.embed_tokens.weight.device
    weights = [[torch.randn(1, generator=g).item() for _ in b[0]] for b in batches]
    print(f"# {len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens, {len(batches)} micro-batches of "
          f"{a.micro}", flush=True)
    params = list(shared.lora.slots.values())
    for p in params:
        p.requires_grad_(True)
    for name, (checkpoint, keys) in VARIANTS.items():
        if name in skip:
            continue
        kernels = dataclasses.replace(eng.runner.forward.kernels, **keys)
        tf = TrainableForward(eng.runner.forward, eng.lora, checkpoint=checkpoint, kernels=kernels)
        timed(name, lambda: engine_step(tf, shared, batches, weights), a.rounds, params)
        if name in a.profile.split(","):
            profile(name, tf, shared, batches[0], weights[0])
            for p in params:
                p.grad = None
        del tf
    if "transformers" not in skip:
        shared.engine_forward = False
        shared.trainer_view()  # pristine weights, peft's adapters live: what task.trainer_forward=transformers runs
        timed("transformers", lambda: transformers_step(shared.peft_model, batches, weights, device), a.rounds, params)


if __name__ == "__main__":
    main()
