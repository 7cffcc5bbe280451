"""build_engine(cfg): model -> ModelSpec -> KV pool -> masks -> runner (+ CUDA graphs) -> Engine."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Optional

import torch
from omegaconf import DictConfig

from flexgemma.model.compiled import CompileCounter, compile_fn
from flexgemma.config.schema import Config, ConfigError
from flexgemma.engine.block_mask import MaskBuilder
from flexgemma.engine.engine import Engine
from flexgemma.engine.kv_cache import KVCache, PoolDemand
from flexgemma.engine.cuda_graphs import DecodeGraphs, resolve_buckets
from flexgemma.engine.runner import ModelRunner
from flexgemma.engine.sampler import InvariantSampler, sample
from flexgemma.engine.warm import eager_decode_steps, warm_up
from flexgemma.engine.scheduler import Scheduler
from flexgemma.model.attention import AttentionKernels, InvariantAttentionKernels, check_varlen
from flexgemma.model.forward import GemmaForward
from flexgemma.model.glue import ROW_ARGS, make_ops
from flexgemma.model.invariant.rows import padded_rows
from flexgemma.model.estimate import describe, estimate_build, refuse_if_too_large
from flexgemma.model.load import build_model, free_memory
from flexgemma.model.lora import attach_lora
from flexgemma.model.projections import fuse_projections
from flexgemma.model.spec import FULL, ModelSpec
from flexgemma.config.resolve import AUTO_KERNEL_KEYS, Resolved, resolve, resolve_device

log = logging.getLogger("flexgemma")

# Room left beside the KV pool for activations of the largest prefill step and the sampler.
_ACTIVATION_RESERVE = 2 << 30


def _reclaim_window(cfg: Config, spec: ModelSpec, max_len: int) -> Optional[int]:
    """The sliding window whose layers get a page group of their own, or None (one group)."""
    windows = {s.window for s in spec.layers if s.window is not None}
    if not cfg.kv.reclaim_sliding or len(windows) != 1 or len(spec.layer_types) < 2:
        return None
    window = windows.pop()
    return window if window < max_len else None


def _pool_sizes(cfg: Config, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                max_len: int, demand: PoolDemand = PoolDemand()) -> tuple[int, Optional[int]]:
    """(pages of the group that holds every position, pages of the sliding layers' own group or None).

    On a GPU without kv.max_pages: what `demand` needs (at most engine.max_batch_size sequences of at
    most engine.max_model_len tokens), never less than one sequence of max_model_len, and never more
    than kv.memory_fraction of the free memory allows. The sliding layers' group is sized by `demand`
    on every device: a later request longer than the job's prompts may then find too few of its
    pages for one prefill chunk, and the engine says so (raise kv.max_pages or lower
    engine.max_prefill_tokens)."""
    page = cfg.kv.page_size
    pages = lambda tokens: -(-tokens // page)  # noqa: E731
    need = pages(max_len) + 1  # one sequence of max_model_len, plus the sink page
    seqs = min(cfg.engine.max_batch_size, demand.seqs or cfg.engine.max_batch_size)
    tokens = min(max_len, demand.tokens or max_len)
    window = _reclaim_window(cfg, spec, max_len)
    window_pages = None
    if window is not None:
        per_seq = pages(window) + 2  # the window, the page being filled, one boundary page
        # a prefill chunk's pages, held briefly: the job's longest prompt bounds it when it is known
        chunk = pages(min(cfg.engine.max_prefill_tokens, tokens))
        window_pages = seqs * min(per_seq, pages(tokens) + 1) + chunk + 1
    window_types = {s.layer_type for s in spec.layers if window is not None and s.window == window}
    full_types = [t for t in spec.layer_types if t not in window_types]
    if cfg.kv.max_pages is not None:
        n = int(cfg.kv.max_pages)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cfg.kv.memory_fraction - _ACTIVATION_RESERVE
        if window_pages is not None:
            budget -= window_pages * KVCache.page_bytes(spec, page, dtype, window_types)
        n = int(budget // KVCache.page_bytes(spec, page, dtype, full_types))
        if cfg.kv.fit_demand:
            n = min(n, max(seqs * pages(tokens) + 1, need))
    else:
        n = int(cfg.kv.cpu_pages)
    if n < need:
        raise ConfigError(
            f"the KV pool of {n} pages of {page} tokens cannot hold one sequence of engine.max_model_len={max_len} "
            f"tokens ({need} pages with the sink page): raise kv.max_pages / kv.memory_fraction or lower "
            "engine.max_model_len"
        )
    if window_pages is not None:
        # never more than the full group has; never fewer than one sequence's largest chunk needs
        window_pages = max(min(window_pages, n), chunk + per_seq + 1)
    return n, window_pages


def _refuse_if_too_large(cfg: Config, device: torch.device) -> None:
    """Before building: a model too large for this device is refused with an estimate (ConfigError)."""
    est = estimate_build(cfg.model, cfg.quant, device)
    if est is None:
        return
    if device.type == "cuda":
        tokens = int(cfg.kv.max_pages or 0) * cfg.kv.page_size or int(cfg.engine.max_model_len)
    else:
        tokens = int(cfg.kv.cpu_pages) * cfg.kv.page_size
    est_kv = est.kv_bytes_per_token * tokens
    log.info(describe(est, est_kv, device))
    refuse_if_too_large(est, est_kv, device, free_memory(device))


def build_engine(cfg=None, demand: PoolDemand = PoolDemand(), *, model: Optional[str] = None,
                 quant: Optional[str] = None, lora: Optional[str] = None, **overrides) -> Engine:
    """Builds the engine a config describes: the typed Config of flexgemma.config.compose (or a composed
    DictConfig, typed here once); `demand` sizes the KV pool on a GPU (the run orchestrator passes
    its workload's).

    Or from Python arguments, composed like the CLI's overrides (the caller's Hydra state is left
    alone): build_engine(model="e2b", quant="bnb4", lora="r16", device="cpu", **{"kv.page_size": 8});
    a key may also spell dots as double underscores (engine__max_batch_size=16)."""
    from flexgemma.config.compose import to_config
    from flexgemma.config.overrides import engine_config

    if isinstance(cfg, str):  # build_engine("tiny")
        model, cfg = model or cfg, None
    if cfg is None:
        cfg = engine_config(model=model, quant=quant, lora=lora, **overrides)
    elif not isinstance(cfg, (Config, DictConfig)):
        raise TypeError(f"build_engine takes a config (flexgemma.config.compose) or keyword arguments, got {cfg!r}")
    elif model or quant or lora or overrides:
        raise TypeError("build_engine: give either a config or keyword arguments, not both")
    return _build_from_config(to_config(cfg), demand)


def _build_from_config(cfg: Config, demand: PoolDemand) -> Engine:
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    r = resolve(cfg, device)  # every auto decided here, before anything is built
    if r.kernels.prefill_attention == "varlen":
        check_varlen(r.device, r.dtype, r.batch_invariant)
    if not cfg.model.allow_large_cpu:
        _refuse_if_too_large(cfg, device)
    # quantisation: quant=bnb4 quantises inside build_model, module by module as weights are made or
    # loaded (never the whole bf16 model on the device); info gets quant/fraction_4bit
    model, tokenizer, info = build_model(cfg.model, device, quant_cfg=cfg.quant)
    if r.kernels.fuse_projections:  # before peft wraps the modules: adapters then merge into the fused rows
        info["fused_projections"] = fuse_projections(model)
    # LoRA
    lora = attach_lora(model, cfg.lora, r.lora_merge)  # merged into the weights before the KV pool and graphs
    return assemble_engine(cfg, model, tokenizer, info, lora, r, demand, t0)


def _forward(cfg, r: Resolved, model, spec: ModelSpec, cache: KVCache, max_len: int, counter: CompileCounter,
             lora, info: dict) -> GemmaForward:
    """The model's forward with the resolved kernels (attention, MoE, 4-bit projections), or with the
    batch-invariant ones (engine.batch_invariant)."""
    if not r.batch_invariant:
        attention = AttentionKernels(r.attention_backend, r.kernels, counter=counter)
        ops = make_ops(counter if r.compile else None, r.kernels)
        forward = GemmaForward(model, spec, cache.pools, cfg.attn, max_len, attention, ops, lora, r.kernels)
    else:
        from flexgemma.model.invariant.experts import InvariantExperts
        from flexgemma.model.invariant.matmul import linear

        attention = InvariantAttentionKernels(cache.page_size, r.kernels)
        if r.device.type == "cuda" and r.quantised and r.kernels.invariant_4bit_scale == "weights":
            log.warning("kernels.invariant_4bit_scale=weights has not yet passed its GPU invariance test "
                        "(docs/configuration.md): a 4-bit MoE's prefill may give a token other bits than its "
                        "decode; kernels.invariant_4bit_scale=products is the invariant one")
        ops = make_ops(counter if r.compile else None, dataclasses.replace(r.kernels, moe="grouped_mm"))
        ops.experts_kernel = InvariantExperts(r.kernels)
        if r.device.type == "cpu":
            for name, rows in ROW_ARGS.items():
                setattr(ops, name, padded_rows(getattr(ops, name), rows))
        invariant = functools.partial(linear, k_chunk=r.kernels.invariant_k_chunk,
                                      split_below_tiles=r.kernels.invariant_split_below_tiles,
                                      flatten=r.kernels.invariant_flatten,
                                      split_sum=r.kernels.invariant_split_sum,
                                      loads=r.kernels.invariant_loads)
        forward = GemmaForward(model, spec, cache.pools, cfg.attn, max_len, attention, ops, lora, r.kernels, invariant)
    if r.quantised:
        groups = forward.linear4bit_groups()
        info.update({"linear4bit_kernel": r.kernels.linear4bit, "linear4bit_groups": len(groups),
                     "quant/linear4bit_extra_bytes": sum(g.extra_bytes for g in groups)})
    return forward


def _prepare_decode(cfg, runner: ModelRunner, r: Resolved) -> float:
    """Captures the decode graphs (GPU) or compiles the decode step at each attention row count, so
    nothing compiles inside a timed round. Returns the seconds it took."""
    t1 = time.perf_counter()
    if cfg.cudagraph.enabled and r.device.type == "cuda":
        buckets = [b for b in resolve_buckets(cfg.cudagraph.buckets, cfg.engine.max_batch_size)
                   if b >= runner.min_decode_rows]
        runner.graphs = DecodeGraphs(runner, buckets)
        runner.graphs.capture()  # compiles the kernels on its warm-up steps
    elif r.compile or r.attention_backend == "flex":
        eager_decode_steps(runner)
    return time.perf_counter() - t1


def _engine_facts(runner: ModelRunner, spec: ModelSpec, dtype: torch.dtype, max_len: int, compiled: int,
                  r: Resolved) -> dict:
    """What the build decided, for the job's info and summary."""
    graphs = runner.graphs
    return dict(
        compile_glue=r.compile, compiled_graphs=compiled, cudagraphs=graphs is not None,
        capture_seconds=graphs.capture_seconds if graphs else 0.0,
        cudagraph_buckets=list(graphs.buckets) if graphs else [],
        graph_pool_gib=graphs.pool_bytes / 2**30 if graphs else 0.0,
        attention_decode_rows=list(r.kernels.decode_rows), attention_backend=r.attention_backend,
        # KV memory per token of context: every KV-writing layer (short contexts), and the full-attention
        # layers alone (what each token adds once the sliding layers hold their window); an 8-bit cache halves both
        kv_bytes_per_token=spec.kv_bytes_per_token(dtype.itemsize),
        kv_bytes_per_token_full_layers=spec.kv_bytes_per_token(dtype.itemsize, [FULL]),
        kv_bytes_per_max_len_seq=spec.kv_bytes_per_sequence(max_len, dtype.itemsize),
        # what each `auto` of the kernels group became on this device (config_resolved.yaml keeps `auto`)
        **{f"kernels/{name}": getattr(r.kernels, name) for name in AUTO_KERNEL_KEYS},
    )


def assemble_engine(cfg, model, tokenizer, info: dict, lora, r: Resolved,
                    demand: PoolDemand = PoolDemand(), t0: Optional[float] = None) -> Engine:
    """The engine around a built model: KV pool, kernels, masks, runner, CUDA graphs, scheduler."""
    t0 = time.perf_counter() if t0 is None else t0
    device, use_compile = r.device, r.compile
    spec = ModelSpec.from_hf_config(model.config)
    dtype = model.model.embed_tokens.weight.dtype
    max_len = min(int(cfg.engine.max_model_len), spec.max_position)
    num_pages, window_pages = _pool_sizes(cfg, spec, dtype, device, max_len, demand)
    cache = KVCache(spec, num_pages, cfg.kv.page_size, dtype, device, window_pages,
                    sleep_mode=bool(cfg.engine.sleep_mode))
    counter = CompileCounter()
    forward = _forward(cfg, r, model, spec, cache, max_len, counter, lora, info)
    if lora is not None:
        info.update(lora.build_info())
    masks = MaskBuilder(spec, cache, cfg.attn.q_block_size, max_len, r.kernels, invariant=r.batch_invariant)
    sample_fn = compile_fn(sample, counter) if use_compile else sample
    if r.batch_invariant:
        sample_fn = InvariantSampler(sample_fn)
    runner = ModelRunner(forward, cache, masks, cfg.engine.max_batch_size, cfg.attn.q_block_size, sample_fn,
                         r.kernels)
    # the compiled glue is traced apart for one row (torch specialises a size of 1): under batch invariance
    # a lone decode row runs padded to two, so it meets the kernels every other batch meets
    runner.min_decode_rows = 2 if r.batch_invariant and use_compile and cfg.engine.max_batch_size > 1 else 1
    info["compile_capture_seconds"] = _prepare_decode(cfg, runner, r)
    scheduler = Scheduler(cache, cfg.engine.max_batch_size, cfg.engine.max_prefill_tokens,
                          prefix_cache=bool(cfg.kv.prefix_cache))
    info.update(_engine_facts(runner, spec, dtype, max_len, counter.count, r))
    info["batch_invariant"] = r.batch_invariant
    info.update(device=str(device), kv_pages=num_pages, kv_window_pages=window_pages or 0,
                page_size=cfg.kv.page_size, kv_pool_bytes=cache.nbytes, max_model_len=max_len,
                async_decode=bool(cfg.engine.async_decode), prefix_cache=scheduler.prefix is not None)
    if any(s.moe for s in spec.layers):
        info["moe_kernel"] = r.kernels.moe
    engine = Engine(model, spec, runner, scheduler, max_len, seed=int(cfg.seed), tokenizer=tokenizer, info=info,
                    lora=lora)
    engine.compile_counter = counter
    engine.async_decode = bool(cfg.engine.async_decode)
    if cfg.engine.warmup and (device.type == "cuda" or use_compile):  # the CPU's eager steps have nothing to warm
        info.update(warm_up(engine, demand, int(cfg.engine.max_prefill_tokens)))
    info["build_seconds"] = time.perf_counter() - t0
    log.info(
        "engine: %s (%s, %.2fB params, %s) on %s; KV pool %d pages x %d tokens = %.2f GiB",
        info["name"], info["weights"], info["params"] / 1e9, info["dtype"], device, num_pages,
        cfg.kv.page_size, cache.nbytes / 2**30,
    )
    return engine
