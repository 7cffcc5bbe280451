"""The kernel choices the engine's constructors read: the `kernels` config group (config.KernelsConfig)
with every `auto` decided for a device, and the row counts flex decode attention is compiled at.

resolve.resolve_kernels builds one `Kernels` per engine; the forward, its ops, the 4-bit groups, the
routed experts, the mask builder and the runner take it and read nothing else for a choice. It is the
group's own dataclass with one field more, so a new key of the group reaches every constructor with
no second definition. Built by hand (tests, kernel benchmarks) it has the group's defaults, and an
`auto` there runs torch's kernels: triton runs only where resolve decided it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from flexgemma.config.schema import KernelsConfig

# each row count flex decode attention is compiled at is this factor below the next: a step padded to
# more rows gets fewer KV splits a row (torch's flex decoding splits a row's KV over SMs // (rows x KV
# heads) programs), and every size costs two compiles (one per head_dim)
_ROW_FACTOR = 4


@dataclass
class Kernels(KernelsConfig):
    # the row counts flex decode attention is compiled at (attention_row_sizes of engine.max_batch_size);
    # empty where attention runs at the batch it is given (the dense and flex_eager backends)
    decode_rows: tuple[int, ...] = ()

    def padded_rows(self, b: int) -> int:
        """The row count a decode step of b queries runs attention at."""
        if not self.decode_rows:
            return b
        i = bisect.bisect_left(self.decode_rows, b)
        if i == len(self.decode_rows):
            raise ValueError(f"a decode step of {b} rows: the attention kernels take at most {self.decode_rows[-1]} "
                             "(engine.max_batch_size)")
        return self.decode_rows[i]


def attention_row_sizes(max_batch: int, smallest: int = 16) -> list[int]:
    """The row counts flex decode attention is compiled at: max_batch, then a quarter of it each
    time down to `smallest` (512: 32, 128, 512; 64: 16, 64). A step pads its queries to the next one
    up: at most 4x the rows, and two compiles (one per head_dim) a size, not two per bucket."""
    sizes = [max_batch]
    while sizes[-1] // _ROW_FACTOR >= smallest:
        sizes.append(sizes[-1] // _ROW_FACTOR)
    return sorted(sizes)
