"""The engine's forward, with the backward a LoRA trainer needs (`task.trainer_forward=engine`).

`TrainableForward` runs the engine's own model code and kernels (GemmaForward over the batch-invariant
kernels: the same products, attention, glue and experts, on the same weights, merged or 4-bit) on
packed, unpadded sequences, and computes each token's log-probability a slice of the vocabulary at a
time (never the [tokens x vocab] logits). Its forward values are the engine's bit for bit; only the
backward is new, and it is plain maths: every op is an `exact` pair, the engine's function for the
forward and a differentiable torch reference of the same maths for the gradients (recomputed in the
backward from the op's inputs). Gradients reach the LoRA factors (merged adapters: through the
low-rank form of W + s B A, never a full-size weight gradient) and the activations through frozen
weights, 4-bit ones included.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from flexgemma.model import glue
from flexgemma.model.invariant.attention import RowTable, paged_attention
from flexgemma.model.invariant.logprobs import LogprobStream, lanes
from flexgemma.model.invariant.rows import pad_rows, padded_row_count, serial


# -- an engine op with a reference backward ------------------------------------------------------
class _Exact(torch.autograd.Function):
    """out = fn(*args) (no graph); the backward differentiates ref(*args), recomputed."""

    @staticmethod
    def forward(ctx, name, fn, ref, *args):
        ctx.ref, ctx.name = ref, name
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])
        with torch.no_grad(), record_function(f"trainer.engine.{name}"):
            out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*[o for o in outs if torch.is_tensor(o) and not o.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        wants = []
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            needs = ctx.needs_input_grad[i + 3]
            args[i] = t.detach().requires_grad_(needs) if needs else t
            if needs:
                wants.append(i)
        if not wants:
            return (None, None, None) + (None,) * len(args)
        with torch.enable_grad(), record_function(f"trainer.backward.{ctx.name}"):
            out = ctx.ref(*args)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and torch.is_tensor(o) and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wants], [g for _, g in pairs],
                                      allow_unused=True)
        result = [None] * len(args)
        for i, g in zip(wants, got):
            result[i] = g
        return (None, None, None, *result)


def exact(fn: Callable, ref: Callable, name: str = "") -> Callable:
    """fn's values with ref's gradients (fn and ref: the same maths); `name` labels both in a profile."""
    name = name or getattr(ref, "__name__", "op")
    return lambda *args: _Exact.apply(name, fn, ref, *args)


def storage_alias(a: torch.Tensor) -> torch.Tensor:
    """A new tensor over `a`'s memory with its sizes, strides and storage offset, nothing copied: made in
    inference mode it is an inference tensor, outside it an ordinary one, whatever `a` is. torch.compile
    guards on the layout and on which of the two a tensor is, and the engine passes its glue inference
    tensors, some views of a fused projection's output (a view would keep its base's kind)."""
    return torch.empty(0, dtype=a.dtype, device=a.device).set_(a.untyped_storage(), a.storage_offset(), a.shape,
                                                               a.stride())


def glue_references(how: str) -> dict[str, Callable]:
    """The maths the backward differentiates for each row-wise glue function (glue.ROW_ARGS), as the
    resolved kernels.trainer_glue_backward says: glue's own functions op by op (eager), or the same
    functions through torch.compile (compiled: AOTAutograd fuses each one's recomputed forward and its
    backward into a few kernels, where eager launches one a torch op; auto, unresolved in a hand-built
    Kernels(): eager, as its other autos run torch's kernels). Compiled with a counter of their own, so the
    engine's compiled glue (what the forward calls) is never compiled again."""
    fns = {name: getattr(glue, name) for name in glue.ROW_ARGS}
    if how != "compiled":
        return fns
    from flexgemma.model.compiled import CompileCounter, compile_fn

    counter = CompileCounter()
    return {name: compile_fn(fn, counter) for name, fn in fns.items()}


def as_the_engine_calls(fn: Callable, row_args: tuple[int, ...]) -> Callable:
    """The engine's compiled glue function `fn`, called as the engine calls it: in inference mode, its
    per-row arguments inference tensors laid out as the engine's (aliases of the trainer's), on the CPU on
    one thread. torch.compile guards on each of these, so a call that differs in one compiles the function
    again, and a new compile may reduce a row with other tiles (on the H200 it did: 1-2 rows in 349 a bit
    apart); this way the trainer runs the kernels the engine compiled. The outputs come back as ordinary
    tensors over the same memory (autograd saves no inference tensor)."""
    def call(*args):
        cpu = not args[row_args[0]].is_cuda
        with torch.inference_mode(), (serial() if cpu else nullcontext()):
            out = fn(*[storage_alias(a) if i in row_args and torch.is_tensor(a) else a for i, a in enumerate(args)])
        return tuple(storage_alias(o) for o in out) if isinstance(out, tuple) else storage_alias(out)

    return call


class _Linear(torch.autograd.Function):
    """x @ w.T by the engine's product; the backward is F.linear's (no recomputed forward: a product's
    gradients need only its inputs)."""

    @staticmethod
    def forward(ctx, x, w, linear):
        ctx.save_for_backward(x, w)
        with torch.no_grad(), record_function("trainer.engine.linear"):
            return linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with record_function("trainer.backward.linear"):
            gx = g @ w if ctx.needs_input_grad[0] else None
            gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def trainable_linear(linear: Callable) -> Callable:
    """`linear(x, w)` (the engine's product) with gradients for x and w."""
    return lambda x, w: _Linear.apply(x, w, linear)


class Recompute:
    """What a checkpointed layer's recomputation in the backward runs, as kernels.trainer_recompute says:
    the engine's kernels again (engine: the first forward's activations bit for bit), or each op's
    reference maths (reference: torch's products, the references' glue and attention). The recomputed
    values feed only the gradients, so the logprobs stay the engine's either way. MoE layers recompute
    with the engine's kernels: a router recomputed by other kernels could pick other experts, and the
    backward's graph is the first forward's."""

    def __init__(self, how: str):
        self.by_reference, self.active = how == "reference", False

    def pick(self, engine_fn: Callable, reference_fn: Callable) -> Callable:
        """engine_fn, or reference_fn while a layer is recomputed by reference."""
        if not self.by_reference:
            return engine_fn
        return lambda *args: reference_fn(*args) if self.active else engine_fn(*args)

    def contexts(self, layer):
        """torch.utils.checkpoint's context_fn for `layer` (its spec): (the first forward's context, the
        recomputation's)."""
        if not self.by_reference or layer.moe:
            return nullcontext(), nullcontext()
        return nullcontext(), self._recomputing()

    @contextmanager
    def _recomputing(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _torch_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype))


class _MergedLora(torch.autograd.Function):
    """x @ W.T with W the engine's merged weight (pristine + sum_i s_i B_i A_i, rows split among
    members): the forward is the engine's product over W itself; the backward gives x its gradient
    through W and each adapter's factors theirs through the low-rank form (no [out, in] gradient), in
    `backward_dtype` (kernels.trainer_backward_dtype: float32, or None for x's dtype, as peft's own
    backward computes them; float32 copies of a 23k-token step's gate/up gradient alone are 3.4 GB)."""

    @staticmethod
    def forward(ctx, x, linear, weight, members, backward_dtype, *factors):
        ctx.members = members  # per member: (first row, rows, [(index of A in factors, index of B, scale)])
        ctx.backward_dtype = backward_dtype or x.dtype
        ctx.save_for_backward(x, weight, *factors)
        with torch.no_grad(), record_function("trainer.engine.merged_linear"):
            return linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight, *factors = ctx.saved_tensors
        dt = ctx.backward_dtype
        with record_function("trainer.backward.merged_linear"):
            gx = g @ weight if ctx.needs_input_grad[0] else None
            grads = [None] * len(factors)
            x2 = x.reshape(-1, x.shape[-1]).to(dt)
            g2 = g.reshape(-1, g.shape[-1]).to(dt)
            for first, rows, adapters in ctx.members:
                gi = g2[:, first: first + rows]  # a strided view: the products read it in place
                for ia, ib, scale in adapters:
                    a, b = factors[ia].to(dt), factors[ib].to(dt)
                    grads[ib] = ((gi.t() @ (x2 @ a.t())) * scale).to(factors[ib].dtype)
                    grads[ia] = (((gi @ b).t() @ x2) * scale).to(factors[ia].dtype)
        return (gx, None, None, None, None, *grads)


@dataclass
class PackedRows:
    """One layer type's view of a packed batch for the training attention: each sequence's queries
    are its tokens, in order, at positions 0..n-1."""

    starts: list[int]
    lengths: list[int]
    positions: torch.Tensor  # [T]
    window: Optional[int]
    _pages: Optional[tuple] = field(default=None, init=False, repr=False)
    _batches: dict = field(default_factory=dict, init=False, repr=False)

    def batches(self, heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sequences as padded batches for the attention reference, per batch (index [B, n] of each
        sequence's tokens in the packed rows, a padded place repeating its sequence's first; the valid
        places' flat indices into [B * n], in packed order: an index, not a mask, so that taking them
        never waits for the GPU), consecutive sequences while a batch's float32 scores [B, heads, n, n]
        stay within _REFERENCE_SCORES values. Built once per batch."""
        if heads not in self._batches:
            groups, first = [], 0
            for i in range(1, len(self.lengths)):
                n = max(self.lengths[first: i + 1])
                if (i + 1 - first) * heads * n * n > _REFERENCE_SCORES:  # sequence i opens the next batch
                    groups.append((first, i))
                    first = i
            groups.append((first, len(self.lengths)))
            device, out = self.positions.device, []
            for a, b in groups:
                n = max(self.lengths[a:b])
                place = torch.arange(n)
                at = torch.stack([s + torch.where(place < m, place, 0) for s, m in
                                  zip(self.starts[a:b], self.lengths[a:b])])
                valid = place[None, :] < torch.tensor(self.lengths[a:b])[:, None]
                take = (torch.arange(b - a)[:, None] * n + place[None, :])[valid]
                out.append((at.to(device), take.to(device)))
            self._batches[heads] = out
        return self._batches[heads]

    def pages(self, page: int) -> tuple[torch.Tensor, torch.Tensor, int, RowTable]:
        """(each token's slot [T], the page table [sequences + 1, pages], slots in all, the queries'
        RowTable) of the batch laid out as a paged pool of `page`-slot pages (the engine's page size):
        each sequence on pages of its own, page 0 left empty, the table's last row listing no page.
        Built once per batch, read by every layer."""
        if self._pages is None or self._pages[0] != page:
            device = self.positions.device
            counts = [-(-n // page) for n in self.lengths]
            table = torch.full((len(counts) + 1, max(counts + [1])), -1, dtype=torch.int32)
            slot_of = torch.empty(int(self.positions.shape[0]), dtype=torch.long)
            nxt = 1
            for i, (start, n, p) in enumerate(zip(self.starts, self.lengths, counts)):
                table[i, :p] = torch.arange(nxt, nxt + p, dtype=torch.int32)
                slot_of[start: start + n] = nxt * page + torch.arange(n)
                nxt += p
            q_row = torch.repeat_interleave(torch.arange(len(self.lengths), dtype=torch.int32),
                                            torch.tensor(self.lengths))
            table = table.to(device)
            rows = RowTable(table, q_row.to(device), self.positions.int(), self.window, False, max(self.lengths),
                            list(zip(self.starts, self.lengths)))
            self._pages = (page, (slot_of.to(device), table, nxt * page, rows))
        return self._pages[1]


class PackedKV:
    """The K/V of the packed batch being trained on, per KV-writing layer, as autograd tensors (what
    `PagedAttention` writes and reads in place of the engine's pools)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._source: dict[int, int] = {}

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor, slots=None) -> None:
        self._kv[layer_index] = (k, v)

    def layer_kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer_index]

    def clear(self) -> None:
        self._kv.clear()


def _staged(k: torch.Tensor, rows: PackedRows, page: int) -> torch.Tensor:
    """k [T, Hkv, D] laid out as the paged pool [1, Hkv, slots, D] of `rows.pages(page)`."""
    slot_of, _, slots, _ = rows.pages(page)
    pool = k.new_zeros(1, k.shape[1], slots, k.shape[2])
    pool[0, :, slot_of] = k.transpose(0, 1)
    return pool


_REFERENCE_SCORES = 1 << 28  # float32 scores of one batched attention reference call (1 GiB)


def _attention_reference(q, k, v, rows: PackedRows, dtype: Optional[torch.dtype] = torch.float32):
    """Softmax attention of each sequence in `dtype` (None: q's; causal, sliding where the layer slides),
    GQA, the sequences padded into batches (one call a batch, not one a sequence). A valid query's causal
    mask never reaches its sequence's padding; a padded query's output is dropped, so its gradient is zero."""
    outs, dtype = [], dtype or q.dtype
    for at, take in rows.batches(q.shape[1]):
        qs, ks, vs = (t.to(dtype)[at].transpose(1, 2) for t in (q, k, v))  # [B, heads, n, D]
        n = at.shape[1]
        if rows.window is None or n <= rows.window:  # causal alone: SDPA's fused kernels take it, not a mask
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0, enable_gqa=True)
        else:
            pos = torch.arange(n, device=q.device)
            allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - rows.window)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=1.0, enable_gqa=True)
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]).index_select(0, take))
    return torch.cat(outs).to(q.dtype)


class PackedAttention:
    """The training forward's attention kernels: the engine's paged attention over the packed K/V
    staged as pages (the same chunks and tiles at the same positions: the engine's bits), with the
    reference's gradients."""

    backend = "invariant"
    decode_rows = None

    def __init__(self, engine_kernels, backward_dtype: Optional[torch.dtype], recompute: Recompute):
        self.engine, self.backward_dtype, self.recompute = engine_kernels, backward_dtype, recompute

    def padded_rows(self, b: int) -> int:
        return b

    def prefill(self, q, k, v, rows: PackedRows, options=None):
        page = self.engine.page_size

        def engine_attention(q, k, v):
            table_rows = rows.pages(page)[3]
            return paged_attention(q, _staged(k, rows, page), _staged(v, rows, page), table_rows, page,
                                   self.engine.options)

        def reference(q, k, v):
            return _attention_reference(q, k, v, rows, self.backward_dtype)

        return exact(self.recompute.pick(engine_attention, reference), reference, "attention")(q, k, v)

    decode = prefill


# -- projections -----------------------------------------------------------------------------------
class MergedProjection:
    """Members' merged weights as one matrix (a fused weight, or one module's): the engine's product,
    gradients for x and every merged adapter's factors."""

    def __init__(self, weight: torch.Tensor, modules: list, lora, linear: Callable,
                 backward_dtype: Optional[torch.dtype] = torch.float32):
        self.weight, self.linear, self.backward_dtype = weight, linear, backward_dtype
        self.splits = [m.get_base_layer().weight.shape[0] if hasattr(m, "get_base_layer") else m.weight.shape[0]
                       for m in modules]
        self.factors, self.members, first = [], [], 0
        for m, rows in zip(modules, self.splits):
            adapters = []
            if lora is not None and any(m is layer for layer in lora.layers.values()):
                for a in lora.adapter_names:
                    if a in m.lora_A:
                        adapters.append((len(self.factors), len(self.factors) + 1, float(m.scaling[a])))
                        self.factors += [m.lora_A[a].weight, m.lora_B[a].weight]
            self.members.append((first, rows, adapters))
            first += rows

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = _MergedLora.apply(x, self.linear, self.weight, self.members, self.backward_dtype, *self.factors)
        return list(y.split(self.splits, dim=-1))


class TrainableLowRank:
    """Unmerged adapters beside their (4-bit or plain) bases: `lora.LowRankGroup`'s arithmetic over the
    live peft factors, every product the engine's, with gradients."""

    def __init__(self, modules: list, adapters: list[str], dtype: torch.dtype, bases: Callable, linear: Callable):
        self.modules, self.adapters, self.dtype, self.bases, self.linear = modules, adapters, dtype, bases, linear

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        from flexgemma.model.lora import live_factors

        parts = live_factors(self.modules, self.adapters)
        xa = self.linear(x, torch.cat([a for _, a in parts]).to(self.dtype))
        outs, r0 = [], 0
        for y, (b, a) in zip(self.bases(x), parts):
            r = a.shape[0]
            outs.append(y + self.linear(xa[:, r0: r0 + r], b.to(self.dtype)))
            r0 += r
        return outs


def projection_factory(engine_forward, lora, linear: Callable,
                       backward_dtype: Optional[torch.dtype] = torch.float32) -> Callable:
    """`project(owner, names, fused)` for the trainer's GemmaForward: the engine forward's own
    projection of those modules (`GemmaForward.made`; its fused weight, 4-bit group and LoRA group,
    nothing copied), each product through `linear` (the engine's, with gradients); merged adapters'
    factor gradients in backward_dtype (None: the rows' dtype)."""
    from flexgemma.model import projections as P
    from flexgemma.model.lora import LowRankGroup

    def project(owner, names: list[str], fused: Optional[str] = None):
        modules = [getattr(owner, n) for n in names]
        made = engine_forward.made[(id(owner), tuple(names))]
        if isinstance(made, P.FusedLinear):
            return MergedProjection(made.weight, modules, lora, linear, backward_dtype)
        if isinstance(made, LowRankGroup):
            bases = P.DenseGroup(made.bases.modules, linear, made.bases.packed)
            return TrainableLowRank(modules, made.adapters, lora.dtype, bases, linear)
        if not isinstance(made, P.DenseGroup):
            raise TypeError(f"task.trainer_forward=engine needs engine.batch_invariant=true (a projection runs "
                            f"as {type(made).__name__})")
        if lora is not None and lora.merged:
            return _merged_or_dense(modules, lora, linear, backward_dtype)
        return P.DenseGroup(made.modules, linear, made.packed)

    return project


def _merged_or_dense(modules, lora, linear, backward_dtype):
    """Modules one by one, each its merged weight (the tensor the engine's merge writes, whichever
    Parameter the module holds at the moment) with gradients for its factors, or its own weight."""
    merged = {id(t.layer): t.weight for t in lora.targets}
    members = [MergedProjection(merged[id(m)] if id(m) in merged else m.weight, [m], lora, linear, backward_dtype)
               for m in modules]
    return lambda x: [f(x)[0] for f in members]


# -- routed experts ----------------------------------------------------------------------------------
def _expert_product(x: torch.Tensor, w: torch.Tensor, e: int, at: int, factors) -> torch.Tensor:
    """x @ (W_e + sum s B_e A_e).T in x's dtype, W_e = w[at] (stored, or its dequantised copy); the experts'
    adapters in their low-rank form (x A_e.T B_e.T: no [out, in] matrix per adapter), differentiable."""
    y = x @ w[at].to(x.dtype).t()
    for lhs, rhs, scale in factors:
        y = y + scale * ((x @ rhs[e].to(x.dtype).t()) @ lhs[e].to(x.dtype).t())
    return y


def _experts_grouped_reference(x, top_k_index, top_k_weights, gate_up, down, act, gate_up_factors, down_factors):
    """_experts_reference's maths in x's dtype through moe.experts_grouped (the pairs sorted by expert, two
    grouped products with the adapters in low-rank form, 4-bit experts dequantised): on a GPU in bf16,
    torch._grouped_mm and its backward, where the loop launches a few kernels an expert."""
    from flexgemma.model.moe import experts_grouped

    return experts_grouped(x, top_k_index, top_k_weights, gate_up, down, act, adapters=(gate_up_factors, down_factors))


def _experts_reference(x, top_k_index, top_k_weights, gate_up, down, act, gate_up_factors, down_factors):
    """Each expert on the rows routed to it, in float32 (the backward's maths). The (token, slot) pairs are
    sorted by expert once and 4-bit experts dequantised in one call: one host sync a layer, where a
    per-expert nonzero() or index copy would wait for the GPU once an expert."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # an expert's pairs in (token, slot) order
    counts = torch.bincount(flat).tolist()
    used = [e for e, n in enumerate(counts) if n]
    if not torch.is_tensor(gate_up):  # 4-bit: the routed experts only, once
        ids = torch.tensor(used, device=x.device)
        gate_up, down, at = gate_up.dequantize(ids), down.dequantize(ids), {e: i for i, e in enumerate(used)}
    else:
        at = {e: e for e in used}
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        pairs, start = order[start: start + n], start + n
        if not n:
            continue
        tok, slot = pairs // k, pairs % k
        h = _expert_product(x[tok].float(), gate_up, e, at[e], gate_up_factors)
        g, u = h.chunk(2, dim=-1)
        y = _expert_product(act(g) * u, down, e, at[e], down_factors)
        out = out.index_add(0, tok, y * top_k_weights[tok, slot, None].float())
    return out.to(x.dtype)


class TrainableExperts:
    """ops.experts_kernel of the trainer's forward: the engine's experts kernel for the values, the
    reference's gradients for the rows, the router weights and the experts' merged LoRA factors."""

    def __init__(self, engine_kernel, lora, backward_dtype: Optional[torch.dtype] = torch.float32):
        self.engine, self.backward_dtype = engine_kernel, backward_dtype
        # id(merged expert tensor) -> (its pristine copy, [(peft layer, adapter)]): the reference differentiates
        # pristine + s B A, the merged tensor's own maths
        self.factors: dict[int, tuple] = {}
        if lora is not None:
            from flexgemma.model.lora import _delta_factors

            for t in lora.targets:
                if t.weight.dim() == 3:
                    self.factors[id(t.weight)] = (t.pristine, [(t.layer, a) for a in lora.adapter_names
                                                               if a in t.layer.lora_A])
            self._delta = _delta_factors

    def takes(self, *args) -> bool:
        return True

    def _live(self, w) -> tuple:
        """(the weight the reference starts from, live (lhs, rhs, scale) of its adapters)."""
        if id(w) not in self.factors:
            return w, []
        pristine, adapters = self.factors[id(w)]
        return pristine, [self._delta(layer, a) for layer, a in adapters]

    def __call__(self, x, top_k_index, top_k_weights, gate_up, down, act):
        (gu_base, gu), (dn_base, dn) = self._live(gate_up), self._live(down)
        flat = [t for f in gu + dn for t in f[:2]]
        n_gu = len(gu)

        def engine(x, w, *_):
            return self.engine(x, top_k_index, w, gate_up, down, act)

        def reference(x, w, *tensors):
            pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(tensors) // 2)]
            with_scale = [(lhs, rhs, f[2]) for (lhs, rhs), f in zip(pairs, gu + dn)]
            if self.backward_dtype is None:  # kernels.trainer_backward_dtype=model_dtype
                return _experts_grouped_reference(x, top_k_index, w, gu_base, dn_base, act, with_scale[:n_gu],
                                                  with_scale[n_gu:])
            return _experts_reference(x, top_k_index, w, gu_base, dn_base, act, with_scale[:n_gu], with_scale[n_gu:])

        return exact(engine, reference, "experts")(x, top_k_weights, *flat)  # MoE layers recompute by the engine


# -- log-probabilities a slice of the vocabulary at a time ------------------------------------------
_HEAD_FLOATS = 1 << 27  # float32 values of one [rows, vocabulary slice] block in the backward (512 MiB)


def _slice_width(rows: int, vocab: int, lane: int, columns: int = 0) -> int:
    """Vocabulary columns per slice (kernels.trainer_vocab_slice; 0: about _HEAD_FLOATS / rows), in whole
    lane steps (so the lanes see the engine's order)."""
    want = columns or _HEAD_FLOATS // max(rows, 1)
    return min(vocab, max(lane, want // lane * lane))


class _HeadLogprobs(torch.autograd.Function):
    """(log-probabilities of `targets`, entropies) of the rows x [N, H] under lm_head [V, H]: the head
    computed a slice at a time by the engine's product, streamed through the engine's lanes
    (invariant.logprobs), so the values are the sampler's; the backward recomputes each slice."""

    @staticmethod
    def forward(ctx, x, weight, targets, linear, softcap, entropy: bool, columns: int, slice_grad):
        n, v = x.shape[0], weight.shape[0]
        width = _slice_width(n, v, lanes(x.device), columns)
        stream = LogprobStream(n, x.device, softcap)
        target_head = torch.zeros(n, dtype=x.dtype, device=x.device)
        ent = _EntropyStream(n, x.device) if entropy else None
        with torch.no_grad(), record_function("trainer.engine.head"):
            for v0 in range(0, v, width):
                head = linear(x, weight[v0: v0 + width])
                stream.update(head)
                inside = (targets >= v0) & (targets < v0 + head.shape[1])
                target_head = torch.where(inside, head.gather(1, (targets - v0).clamp(0, head.shape[1] - 1)[:, None])[:, 0],
                                          target_head)
                if ent is not None:
                    ent.update(stream.capped(head))
            logp = stream.logprobs(target_head)
        lse = stream.capped(target_head) - logp
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.softcap, ctx.width, ctx.slice_grad = softcap, width, slice_grad
        return logp, ent.entropy() if ent is not None else torch.zeros_like(logp)

    @staticmethod
    def backward(ctx, g, _g_entropy):
        x, weight, targets, lse = ctx.saved_tensors
        gf = g.float()
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        with record_function("trainer.backward.head"):
            for v0 in range(0, weight.shape[0], ctx.width):
                # the products in the model's dtype (float32 accumulation), as transformers' head computes its
                # logits, not through a float32 copy of each slice; float32 models are unchanged
                w = weight[v0: v0 + ctx.width]
                dz = ctx.slice_grad(x @ w.t(), lse, gf, targets - v0, ctx.softcap)
                gx += (dz @ w).float()
        return gx.to(x.dtype), None, None, None, None, None, None, None


def head_slice_grad(h: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, target: torch.Tensor,
                    softcap: Optional[float]) -> torch.Tensor:
    """The gradient of sum_i g_i log p_i(target_i) with respect to one vocabulary slice's head values h
    [N, W] (before the soft-cap), in h's dtype: g (onehot(target) - p) through the cap's derivative. target
    [N]: each row's target column in the slice (outside [0, W): not in it); lse [N]: the rows' log-sum-exp.
    Elementwise only, so torch.compile makes it one pass over the slice (kernels.trainer_glue_backward)."""
    hf = h.float()
    t = torch.tanh(hf / softcap) if softcap is not None else None
    z = t * softcap if t is not None else hf
    onehot = torch.arange(h.shape[1], device=h.device)[None, :] == target[:, None]
    dz = g[:, None] * (onehot.float() - torch.exp(z - lse[:, None]))
    if t is not None:
        dz = dz * (1 - t * t)
    return dz.to(h.dtype)


def head_gradients(how: str) -> Callable:
    """head_slice_grad as the resolved kernels.trainer_glue_backward says: op by op (eager), or compiled
    (one fused kernel a slice instead of ten passes over [rows x slice] float32 values), with a counter of
    its own."""
    if how != "compiled":
        return head_slice_grad
    from flexgemma.model.compiled import CompileCounter, compile_fn

    return compile_fn(head_slice_grad, CompileCounter())


class _EntropyStream:
    """Each row's entropy of the capped logits, accumulated over vocabulary slices (no gradient)."""

    def __init__(self, n: int, device):
        self.m = torch.full((n,), float("-inf"), device=device)
        self.s = torch.zeros(n, device=device)
        self.t = torch.zeros(n, device=device)

    def update(self, z: torch.Tensor) -> None:
        new = torch.maximum(self.m, z.amax(-1))
        scale = torch.exp(self.m - new)
        e = torch.exp(z - new[:, None])
        self.s = self.s * scale + e.sum(-1)
        self.t = self.t * scale + (e * z).sum(-1)
        self.m = new

    def entropy(self) -> torch.Tensor:
        return self.m + torch.log(self.s) - self.t / self.s


# -- the trainer's forward -----------------------------------------------------------------------------
class TrainableForward:
    """Per-token log-probabilities of packed sequences through the engine's forward, with gradients.

    engine_forward: the engine's GemmaForward, built with engine.batch_invariant (its products, attention,
    glue and experts are what this runs); lora: the engine's LoraAdapters (merged weights must be current:
    the caller refreshes them after changing the factors). checkpoint (task.gradient_checkpointing): each
    layer recomputed in the backward, only its input kept; else every op's inputs are kept. kernels: a
    Kernels whose trainer_glue_backward / trainer_backward_dtype pick the backward's maths (default: the
    engine's own; the forward always runs the engine's kernels as built)."""

    def __init__(self, engine_forward, lora=None, checkpoint: bool = True, kernels=None):
        from flexgemma.config.schema import ConfigError
        from flexgemma.model.forward import GemmaForward

        f = engine_forward
        kernels = kernels or f.kernels
        if f.invariant is None:
            raise ConfigError("task.trainer_forward=engine runs the engine's batch-invariant kernels: set "
                              "engine.batch_invariant=true (or task.trainer_forward=transformers)")
        if any(a.fused_kv_write for a in f.attn):
            raise ConfigError("task.trainer_forward=engine computes K and V as the unfused engine does: set "
                              "attn.fused_kv_write=false")
        self.engine, self.lora = f, lora
        recompute = Recompute(kernels.trainer_recompute)
        linear = trainable_linear(recompute.pick(f.invariant, _torch_linear))
        refs = glue_references(kernels.trainer_glue_backward)
        backward_dtype = None if kernels.trainer_backward_dtype == "model_dtype" else torch.float32
        ops = SimpleNamespace(**{name: exact(recompute.pick(as_the_engine_calls(getattr(f.ops, name), rows), refs[name]),
                                             refs[name], name)
                                 for name, rows in glue.ROW_ARGS.items()})
        ops.experts_kernel = TrainableExperts(f.ops.experts_kernel, lora, backward_dtype)
        max_len = next(iter(f.rope.values()))[0].shape[0]
        self.forward = GemmaForward(f.model, f.spec, PackedKV(f.pools.block_size), f.attn_cfg, max_len,
                                    PackedAttention(f.attention, backward_dtype, recompute), ops, lora, f.kernels,
                                    invariant=linear, project=projection_factory(f, lora, linear, backward_dtype))
        self.forward.checkpoint_layers = checkpoint
        self.forward.checkpoint_contexts = recompute.contexts
        self.windows = {s.layer_type: s.window for s in f.spec.layers}
        self.head_grad = head_gradients(kernels.trainer_glue_backward)

    def token_logprobs(self, sequences: list[list[int]], first: list[int], entropy: bool = False,
                       replay: Optional[list] = None) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """For each sequence, the log-probabilities of its tokens from index first[i] on (given those
        before), float32 with gradients; and their entropies (no gradient) when asked. MoE models: `replay`
        (per sequence uint8 [scored tokens, MoE layers, k] or None) routes the scoring rows to those experts
        (R3); `last_routed` then holds each sequence's own routing of them."""
        device = self.engine.model.model.embed_tokens.weight.device
        lengths = [len(s) for s in sequences]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        masks = {t: PackedRows(starts, lengths, positions, w) for t, w in self.windows.items()}
        rows = torch.tensor([a + p - 1 for a, n, f0 in zip(starts, lengths, first) for p in range(f0, n)],
                            dtype=torch.long, device=device)
        targets = ids[rows + 1]
        counts = [n - f0 for n, f0 in zip(lengths, first)]
        self.forward.pools.clear()
        self.forward.replay = self._replay(replay, rows, counts, ids.shape[0]) if replay is not None else {}
        if ids.is_cuda:
            x = self.forward.hidden(ids, positions, dict.fromkeys(self.windows), masks, decode=False)[rows]
        else:
            with serial():  # the engine's CPU forward runs on one thread (model/invariant/rows.py)
                x = self.forward.hidden(ids, positions, dict.fromkeys(self.windows), masks, decode=False)[rows]
        # the K/V stay until the next call: the backward recomputes KV-shared layers, which read them
        routed = self.forward.routed_experts(rows)
        self.last_routed = None if routed is None else [r.cpu().numpy() for r in routed.split(counts)]
        logp, ent = self._head(x, targets, entropy)
        return list(logp.split(counts)), (list(ent.split(counts)) if entropy else None)

    def _replay(self, replay: list, rows: torch.Tensor, counts: list[int], total: int) -> dict[int, torch.Tensor]:
        """MoE layer index -> [T, k] expert ids for the packed rows (-1: the row routes itself)."""
        moe = [s.index for s in self.engine.spec.layers if s.moe]
        given = [r for r in replay if r is not None]
        if not moe or not given:
            return {}
        ids = torch.full((total, len(moe), given[0].shape[-1]), -1, dtype=torch.long)
        for i, (where, r) in enumerate(zip(rows.cpu().split(counts), replay)):
            if r is None:
                continue
            if tuple(r.shape[:2]) != (len(where), len(moe)):
                raise ValueError(f"routing replay: sequence {i} has experts for {r.shape[0]} tokens x {r.shape[1]} "
                                 f"layers, its scored tokens are {len(where)} x {len(moe)} MoE layers")
            ids[where] = torch.as_tensor(r, dtype=torch.long)
        ids = ids.to(rows.device)
        return {layer: ids[:, j] for j, layer in enumerate(moe)}

    def _head(self, x: torch.Tensor, targets: torch.Tensor, entropy: bool):
        weight = self.forward.model.lm_head.weight
        softcap, columns = self.engine.spec.softcap, self.engine.kernels.trainer_vocab_slice
        if x.is_cuda:
            return _HeadLogprobs.apply(x, weight, targets, self.engine.invariant, softcap, entropy, columns,
                                       self.head_grad)
        n = x.shape[0]  # the CPU's invariant padding (model/invariant/rows.py), as the sampler pads its rows
        rows = padded_row_count(n)
        with serial():
            logp, ent = _HeadLogprobs.apply(pad_rows(x, rows), weight, pad_rows(targets, rows), self.engine.invariant,
                                            softcap, entropy, columns, self.head_grad)
        return logp[:n], ent[:n]
