"""torch.compile with every compilation counted.

Dynamo silently falls back to eager past its recompile limit (~20-40x slower for flex_attention);
here the limit is raised, hitting it is an error, and the number of compiled graphs is reported.
"""

from __future__ import annotations

import functools
import types

import torch


class CompileCounter:
    """A torch.compile backend: inductor, counting each graph it compiles."""

    def __init__(self):
        self.count = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.count += 1
        return compile_fx(gm, example_inputs)


def configure_dynamo(recompile_limit: int = 64) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), recompile_limit))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * recompile_limit)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True  # an error, never a silent eager fallback


def own_code(fn):
    """`fn` with a code object of its own. Dynamo keeps compiled entries, and counts recompiles
    against its limit, per code object: without this every engine built in one process adds its
    entries to the same cache (the sixth small engine of a test process hit the limit), and a freed
    engine's entries live on with the function."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


def compile_fn(fn, counter: CompileCounter, dynamic=True):
    """torch.compile with the counting backend and no graph breaks; the compiled entries belong to
    this call alone (see own_code)."""
    configure_dynamo()
    return torch.compile(own_code(fn), backend=counter, fullgraph=True, dynamic=dynamic)
