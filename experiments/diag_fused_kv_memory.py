"""Memory of generate() with kernels.fused_kv_write on (tiny float32, decode graphs), alone in its
process: each generate's peak over what was allocated before it, graphs compiled during it, and the
largest allocations of the second one with their Python frames. (tests/model/test_gpu_model.py's fused KV
write test had compared absolute peaks, which also count what was allocated before a generate began:
the fused engine's was 256 MiB over the default's, in the same process after it.)"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexgemma import SamplingParams, build_engine, compose  # noqa: E402
from flexgemma.engine.warm import compiled_graphs  # noqa: E402

e = build_engine(compose(["device=cuda", "kv.max_pages=128", "engine.max_model_len=1024", "engine.max_batch_size=8",
                          "+model=tiny", "model.dtype=float32", "cudagraph.buckets=[1,2,4,8]",
                          "kernels.fused_kv_write=true"]))
g = torch.Generator().manual_seed(0)
ps = [[2] + torch.randint(3, e.spec.vocab_size, (n - 1,), generator=g).tolist() for n in (3, 20, 45, 70, 9)]
p = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
for i in range(3):
    e.reset_prefix_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    before = compiled_graphs(e)
    if i == 1:
        torch.cuda.memory._record_memory_history(max_entries=100000)
    e.generate(ps, p)
    torch.cuda.synchronize()
    print(f"generate {i}: peak over base {(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MiB, "
          f"compiled graphs {before} -> {compiled_graphs(e)}", flush=True)
    if i == 1:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = [ev for trace in snap["device_traces"] for ev in trace if ev["action"] == "alloc"]
        for ev in sorted(events, key=lambda ev: -ev["size"])[:3]:
            print(f"alloc {ev['size'] / 2**20:.1f} MiB")
            for fr in ev["frames"][:40]:
                if fr["filename"].endswith(".py"):
                    print(f"    {fr['filename']}:{fr['line']} {fr['name']}")
