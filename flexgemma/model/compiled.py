"""torch.compile with every compilation counted.

Dynamo silently falls back to eager past its recompile limit (~20-40x slower for flex_attention);
here the limit is raised, hitting it is an error, and the number of compiled graphs is reported.
"""

from __future__ import annotations

import collections
import functools
import types

import torch

# Triton kernels JIT-compiled in this process, by kernel name (counted once watch_triton() is called)
_TRITON_COMPILED: collections.Counter = collections.Counter()
_TRITON_HOOKED = False


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


def dynamo_graphs() -> int:
    """Graphs torch.compile has built in this process (dynamo's count of unique graphs; 0 without it)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a torch without the counter
        return 0


def watch_triton() -> bool:
    """Count every Triton kernel JIT-compiled from now on (triton's post-compile hook, any hook already
    there still called); False where this Triton has no such hook. Inductor's kernels are not counted:
    their graphs are (dynamo_graphs)."""
    global _TRITON_HOOKED
    if _TRITON_HOOKED:
        return True
    try:
        from triton import knobs
        runtime = knobs.runtime
        before = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def count(*args, fn=None, **kwargs):
        _TRITON_COMPILED[getattr(fn, "name", "?")] += 1
        return before(*args, fn=fn, **kwargs) if before else None

    runtime.jit_post_compile_hook = count
    _TRITON_HOOKED = True
    return True


class CompileWatch:
    """What compiled between start() and stop(): torch.compile graphs and Triton kernels. Work that
    compiles pays for it in its time; once every shape has been seen, a step compiles nothing."""

    def __init__(self):
        self.triton = watch_triton()
        self.start()

    def start(self) -> None:
        self._graphs, self._kernels = dynamo_graphs(), collections.Counter(_TRITON_COMPILED)

    def stop(self) -> dict:
        """{"graphs": n, "kernels": n, "kernel_names": {name: n}} since start() (kernels -1: not counted)."""
        names = _TRITON_COMPILED - self._kernels
        return {"graphs": dynamo_graphs() - self._graphs, "kernels": sum(names.values()) if self.triton else -1,
                "kernel_names": dict(names)}
