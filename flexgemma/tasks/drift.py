"""task=drift: many LoRA refreshes must leave no trace.

`task.cycles` times: perturb the adapter (Gaussian noise of std `task.noise` x each tensor's RMS),
refresh the merged weights through engine.update_lora and generate. Then restore the original
adapter and check, bit for bit:
- drift/base_bit_identical: every pristine base weight hashes as before the cycles;
- drift/merge_bit_identical: the weights the forward reads equal those of the first merge;
- drift/inference_deterministic: greedy tokens after the restore equal those before the cycles.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from flexgemma.config.schema import Config, ConfigError


def perturbed(state: dict[str, torch.Tensor], noise: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of an adapter state with seeded noise of std noise x RMS, tensor by tensor."""
    out = {}
    for i, key in enumerate(sorted(state)):
        v = state[key]
        g = torch.Generator(device=v.device).manual_seed(seed * 1_000_003 + i)
        f = v.float()
        rms = f.pow(2).mean().sqrt()
        out[key] = (f + noise * rms * torch.randn(f.shape, generator=g, device=v.device)).to(v.dtype)
    return out


def run(engine, workload, cfg: Config, recorder) -> dict:
    lora = engine.lora
    if lora is None:
        raise ConfigError("task=drift needs a LoRA adapter: add lora=r16 (or r32, r64, or lora.path=DIR)")
    n = min(len(workload.prompts), cfg.task.max_prompts)
    prompts = workload.prompts[:n]
    greedy = [dataclasses.replace(p, temperature=0.0) for p in workload.params[:n]]

    def tokens():
        return [o.token_ids for o in engine.generate(prompts, greedy)]

    pristine0, merged0 = lora.pristine_digests(), lora.merged_digests()
    original = lora.state_dict()
    before = tokens()
    reports, changed = [], 0
    for c in range(int(cfg.task.cycles)):
        rep = engine.update_lora(perturbed(original, float(cfg.task.noise), seed=c + 1))
        diff = tokens() != before
        changed += diff
        reports.append(rep)
        recorder.log_round({"drift/cycle": c, "drift/tokens_changed": diff,
                            **{f"lora/{k}": v for k, v in rep.items()}})
    restore = engine.update_lora(original)
    after = tokens()
    refresh = [r["refresh_ms"] for r in reports] or [restore["refresh_ms"]]
    summary = {
        "drift/base_bit_identical": lora.pristine_digests() == pristine0,
        "drift/merge_bit_identical": lora.merged_digests() == merged0,
        "drift/inference_deterministic": after == before,
        "drift/cycles": int(cfg.task.cycles),
        "drift/noise": float(cfg.task.noise),
        "drift/cycles_tokens_changed": changed,
        "drift/weights_checked": len(merged0),
        "lora/refresh_ms": statistics.median(refresh),
        "lora/refresh_ms_max": max(refresh),
        "lora/copy_ms": statistics.median(r["copy_ms"] for r in reports) if reports else restore["copy_ms"],
        "lora/merge_ms": statistics.median(r["merge_ms"] for r in reports) if reports else restore["merge_ms"],
        "lora/restore_ms": restore["refresh_ms"],
        "lora/mode": "merged" if lora.merged else "unmerged",
    }
    recorder.log_round({k: v for k, v in summary.items() if k.startswith("drift/")})
    return summary
