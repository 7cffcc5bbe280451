"""One 26B-A4B bnb4 gate_up projection through the fused 4-bit up kernel at 32 rows, without and with
kernels.moe_4bit_prefetch: the two launches Nsight Compute profiles in gpu_suite.sh's stage `ncu_4bit_up`
(per-instruction stall samples: which loads the loop waits on).

    ncu -k regex:_routed_up_kernel -c 2 --section WarpStateStats --section SourceCounters --import-source yes \\
        -o up32 python experiments/ncu_4bit_up.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_4bit_forms import routing, up_dot  # noqa: E402
from flexgemma.model.moe_kernel import UP_TILES  # noqa: E402
from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight  # noqa: E402


def main(rows: int = 32) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    e, h, i, k = 128, 2816, 704, 8
    gate_up = PackedExpertWeight.pack((torch.randn(e, 2 * i, h, device=dev) * 0.02).bfloat16(),
                                      Bnb4Settings(double_quant=True), dev)
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
    index, order, starts = routing(rows, e, k, dev)
    for prefetch in (False, True):
        up_dot(x, gate_up, index, order, starts, i, k, {**UP_TILES, "BLOCK_M": 16, "PREFETCH": prefetch})
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
