"""The 4-bit dequantise kernels on the GPU, every option's weights checked bit for bit against
bitsandbytes' before it is timed.

Dense groups (the dequantise kernel's tiles, linear4bit.DEQUANT_TILES: bytes a program, warps) beside
bitsandbytes' op: past kernels.linear4bit_max_rows rows (31B bnb4 at 128) a decode step dequantises
every 4-bit group and runs one GEMM. Routed experts (moe_kernel.dequantize_slots at a grid of bytes a
program) beside PackedExpertWeight's gather + bitsandbytes' op, at 26B-A4B's shapes, every expert
(prefill) and half of them: torch's path with kernels.moe_dequant triton against bnb.

    python experiments/bench_dequant4bit.py --groups 31b_gate_up,31b_down --out dequant.json
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_linear4bit import GROUPS, time_us  # noqa: E402

EXPERT_SHAPES = {"26b_gate_up": (128, 1408, 2816), "26b_down": (128, 2816, 704)}  # 26B-A4B's [E, R, C]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="31b_qkv_sliding,31b_o_sliding,31b_gate_up,31b_down,gate_up_wide,down_wide")
    ap.add_argument("--bytes", default="1024,2048,4096,8192", help="bytes of one program")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--expert-bytes", default="1024,2048,4096", help="bytes a program of the experts' slot kernel to time ('': none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flexgemma.model import linear4bit as L
    from flexgemma.model.quant import Bnb4Settings, linear4bit_from

    dev, dt = torch.device("cuda"), torch.bfloat16
    s = Bnb4Settings("nf4", True, 64, dt)
    default = dict(L.DEQUANT_TILES)
    grid = [dict(BYTES=b, num_warps=w) for b, w in itertools.product(
        [int(v) for v in args.bytes.split(",")], [int(v) for v in args.warps.split(",")])]
    torch.manual_seed(0)
    res: dict = {"default": default, "groups": {}}
    totals: dict = {}
    for name in args.groups.split(","):
        k, outs = GROUPS[name]
        mods = [linear4bit_from(torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt), s, dev) for n in outs]
        group = L.Linear4bitGroup(mods)
        moved = group.packed.numel() * 5  # 0.5 byte read and 2 written a weight, 2 weights a byte
        ref = group.dequantize_bnb()
        rows = {"bnb": time_us(group.dequantize_bnb)}
        for opts in grid:
            tiles = {**default, **opts}
            if not torch.equal(group.dequantize_triton(tiles), ref):
                raise AssertionError(f"{name} {opts}: not bitsandbytes' weights")
            rows[json.dumps(tiles)] = time_us(lambda: group.dequantize_triton(tiles))
        for key, us in rows.items():
            totals[key] = totals.get(key, 0.0) + us
        best = min((v, key) for key, v in rows.items() if key != "bnb")
        print(f"{name:16s} {moved / 1e6:7.1f} MB moved: bnb {rows['bnb']:7.1f} us "
              f"({moved / rows['bnb'] / 1e6:.2f} TB/s), "
              f"default {rows[json.dumps(default)]:7.1f} us, best {best[0]:7.1f} us "
              f"({moved / best[0] / 1e6:.2f} TB/s) {best[1]}", flush=True)
        res["groups"][name] = rows
        del group, mods, ref
    res["totals_us"] = totals
    for key, us in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"sum over the groups {us:8.1f} us  {key}")
    if args.expert_bytes:
        res["experts"] = time_experts([int(v) for v in args.expert_bytes.split(",")], dev, dt)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


def time_experts(bytes_grid: list, dev: torch.device, dt: torch.dtype) -> dict:
    """EXPERT_SHAPES (NF4, double quantisation): the slot kernel at each bytes-a-program against
    PackedExpertWeight.dequantize, all experts and every other one."""
    from flexgemma.model import moe_kernel
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    s = Bnb4Settings("nf4", True, 64, dt)
    out: dict = {}
    default = moe_kernel.DEQUANT_BYTES
    for name, shape in EXPERT_SHAPES.items():
        w = PackedExpertWeight.pack(torch.randn(*shape, device=dev, dtype=dt) * 0.02, s, dev)
        n = shape[0]
        for label, experts in (("all", None), ("half", torch.arange(0, n, 2, device=dev))):
            ref = w.dequantize(experts)
            ids = (torch.arange(n, device=dev) if experts is None else experts).to(torch.int32)
            moved = ref.numel() * 2.5  # 0.5 byte read and 2 written a weight
            row = {"bnb": time_us(lambda: w.dequantize(experts))}
            for nbytes in bytes_grid:
                if not torch.equal(moe_kernel.dequantize_slots(w, ids, dt, nbytes), ref):
                    raise AssertionError(f"{name} {label} {nbytes} bytes: not bitsandbytes' weights")
                row[f"slots_{nbytes}"] = time_us(lambda: moe_kernel.dequantize_slots(w, ids, dt, nbytes))
            best = min((v, k) for k, v in row.items() if k != "bnb")
            print(f"{name:12s} {label:4s} {moved / 1e6:7.1f} MB moved: gather + bnb {row['bnb']:7.1f} us "
                  f"({moved / row['bnb'] / 1e6:.2f} TB/s), slots {row[f'slots_{default}']:7.1f} us, best "
                  f"{best[0]:7.1f} us ({moved / best[0] / 1e6:.2f} TB/s) {best[1]}", flush=True)
            out[f"{name}/{label}"] = row
            del ref
        del w
    return out


if __name__ == "__main__":
    main()
