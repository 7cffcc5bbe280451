"""Batch invariance of torch's CPU elementwise and row-wise ops.

A CPU elementwise op over a contiguous tensor runs one flat loop: unrolled vector steps, then a scalar
tail, split across threads above a grain size. The vector and scalar paths of exp, tanh, log or gelu
round differently, so a row's bits would depend on where it lands in the flat loop, which depends on
how many rows came before it and on the thread split. Under engine.batch_invariant the CPU path
therefore (1) runs with one intra-op thread (`serial`), and (2) pads the rows of every row-wise
computation to a multiple of `ROW_MULTIPLE` (`padded_rows`), so every flat loop covers whole vector
steps (64 elements: two AVX-512 vectors of bfloat16) and each element takes the vector path.
The GPU needs neither: each element of a CUDA elementwise kernel runs the same code.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 64


@contextmanager
def serial():
    """One intra-op thread for the duration (restored after)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to `rows` (x itself when it has them)."""
    if x.shape[0] == rows:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def padded_row_count(t: int) -> int:
    return max(ROW_MULTIPLE, -(-t // ROW_MULTIPLE) * ROW_MULTIPLE)


def padded_rows(fn: Callable, row_args: Sequence[int]) -> Callable:
    """fn(*args) for a row-wise fn whose arguments at `row_args` are [T, ...] per-row tensors: on the
    CPU those are padded to `padded_row_count(T)` rows and every tensor output cut back to T rows."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        first = args[row_args[0]]
        if first.is_cuda:
            return fn(*args, **kwargs)
        t = first.shape[0]
        rows = padded_row_count(t)
        padded = [pad_rows(a, rows) if i in row_args else a for i, a in enumerate(args)]
        out = fn(*padded, **kwargs)
        if isinstance(out, tuple):
            return tuple(o[:t] if isinstance(o, torch.Tensor) else o for o in out)
        return out[:t] if isinstance(out, torch.Tensor) else out

    return call
