"""Structured config schemas, their ConfigStore registration and the checks that run at composition.

Every key a user can set lives here once, with its type and default. Types and enum choices are
checked by OmegaConf when Hydra composes; value rules that a type cannot express (powers of two, a
ladder without holes) are checked by each group's `__post_init__`, and rules that span groups (a
graph ladder that covers engine.max_batch_size) by `Config.__post_init__`. `validate(cfg)` turns the
composed config into these typed dataclasses once (compose.to_config is where that happens), which
runs every check; a failed one raises a `ConfigError` naming the key and what it accepts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

DEFAULT_MODEL = "tiny"

QUANT_METHODS = ("none", "bnb4")
QUANT_TYPES = ("nf4", "fp4")
# Blocks bitsandbytes' CUDA 4-bit kernels accept (the CPU kernels accept the same).
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


class ConfigError(ValueError):
    """A configuration value that composes but cannot run; the message names the key."""


class FlexgemmaWarning(UserWarning):
    """A warning flexgemma itself gives: a CLI job shows it on the console (run/console.py)."""


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"  # bfloat16 on a GPU, float32 on the CPU
    float32 = "float32"
    bfloat16 = "bfloat16"
    # GPUs without bf16, and the CPU tests of the Triton kernels (Triton's interpreter mishandles bf16);
    # real Gemma weights can overflow its range
    float16 = "float16"


class AttnBackend(str, Enum):
    auto = "auto"  # flex on a GPU, dense on the CPU
    flex = "flex"  # compiled flex_attention kernels
    flex_eager = "flex_eager"  # torch's unfused flex reference
    dense = "dense"  # the same mask_mod + SDPA (fast on the CPU)


class LoggerKind(str, Enum):
    none = "none"
    wandb_offline = "wandb_offline"
    wandb_online = "wandb_online"


@dataclass
class ModelConfig:
    name: str = MISSING  # a variant under conf/model/, or any name when `path` is set
    hf_config: Any = None  # Gemma4TextConfig keyword arguments (the architecture)
    path: Optional[str] = None  # local Hugging Face checkpoint directory
    # a random-weight model's tokenizer (a checkpoint, model.path, brings its own): a directory with
    # tokenizer.json, or one shipped with flexgemma by name (tiny: conf/model/tiny*.yaml); null: none
    tokenizer: Optional[str] = None
    dtype: DType = DType.auto
    seed: int = 0  # random init when there are no weights
    allow_pickle: bool = False  # accept pickled *.bin weights (they can run code)
    # build a model over 1B parameters on a CPU, or one larger than the GPU's free memory, anyway
    # (otherwise refused before building, with an estimate and the CPU-sized variant: model/estimate.py)
    allow_large_cpu: bool = False


@dataclass
class QuantConfig:
    name: str = "bf16"
    method: str = "none"  # none | bnb4
    quant_type: str = "nf4"
    double_quant: bool = False
    block_size: int = 64

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ConfigError(f"quant.method={self.method!r} is invalid: choose one of {QUANT_METHODS}")
        if self.quant_type not in QUANT_TYPES:
            raise ConfigError(f"quant.quant_type={self.quant_type!r} is invalid: choose one of {QUANT_TYPES}")
        if int(self.block_size) not in BLOCK_SIZES:
            raise ConfigError(f"quant.block_size={self.block_size} is invalid: choose one of {BLOCK_SIZES}")


@dataclass
class LoraConfig:
    """A peft LoRA adapter (flexgemma/model/lora.py). Active when rank > 0 or path is set."""

    name: str = "none"
    rank: int = 0  # 0 = no adapter (with `path`: 0 takes the adapter's own r, else it must match)
    alpha: float = 16.0  # scale = alpha / rank
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    experts: bool = True  # MoE models (26B-A4B): also adapt experts.gate_up_proj / experts.down_proj
    seed: int = 0  # random init of A and B (peft would leave B = 0: an adapter that changes nothing)
    init_std_b: float = 0.01  # std of the random B; A ~ N(0, 1/in_features)
    adapter_names: list[str] = field(default_factory=lambda: ["default"])  # >1: all active, deltas summed
    path: Optional[str] = None  # local peft adapter directory (adapter_config.json + safetensors)
    merge: Optional[bool] = None  # null: merged for bf16/fp32 weights, unmerged (peft modules) for 4-bit
    pristine_on_cpu: bool = False  # keep the pristine base weights in pinned CPU memory, not on the GPU

    def __post_init__(self):
        if self.name != "none" and self.rank < 1 and not self.path:
            raise ConfigError(f"lora.rank={self.rank} is invalid: a LoRA rank is at least 1 (or use lora=none)")
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} is invalid: at least 0 (0 = no adapter)")
        if self.rank > 0 or self.path:
            self._check_adapter()

    def _check_adapter(self) -> None:
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha={self.alpha} is invalid: it must be > 0 (the scale is alpha / rank)")
        names = list(self.adapter_names)
        # peft finds adapters by name inside parameter keys: no dots, and no part of its "lora_" prefix
        if not names or len(set(names)) != len(names) or any(not n or "." in n or n in "lora_" for n in names):
            raise ConfigError(
                f"lora.adapter_names={names} is invalid: a non-empty list of distinct names without dots "
                "(and not a part of 'lora_', such as 'a')"
            )
        if self.path and len(names) > 1:
            raise ConfigError(f"lora.path loads one adapter but lora.adapter_names={names} names {len(names)}")
        if not list(self.target_modules) and not self.experts:
            raise ConfigError("lora.target_modules is empty and lora.experts=false: the adapter would target nothing")


@dataclass
class FlexKernel:
    """flex_attention kernel options for one phase; null leaves torch's choice."""

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)  # any other torch kernel option, verbatim


@dataclass
class PhaseKernels(FlexKernel):
    # overrides for the head_dim-512 full-attention layers, merged over the phase's options
    full_attention: FlexKernel = field(default_factory=FlexKernel)


@dataclass
class AttnConfig:
    name: str = "default"
    q_block_size: int = 128  # BlockMask query block for prefill (a KV block is one page: kv.page_size)
    backend: AttnBackend = AttnBackend.auto
    prefill: PhaseKernels = field(default_factory=PhaseKernels)
    decode: PhaseKernels = field(default_factory=PhaseKernels)

    def __post_init__(self):
        _check_pow2("attn.q_block_size", self.q_block_size, 16, 1024)
        for prefix, k in self.kernels():
            _check_kernel(prefix, k)

    def kernels(self) -> list[tuple[str, "FlexKernel"]]:
        """(key prefix, kernel options) of every phase and its full-attention override."""
        return [(f"attn.{phase}{sub}", k) for phase, p in (("prefill", self.prefill), ("decode", self.decode))
                for sub, k in (("", p), (".full_attention", p.full_attention))]

    def check_tiles(self, page_size: int) -> None:
        """Tile rules of the compiled flex kernels (the eager CPU path has no tiles): a kernel walks a
        page in BLOCK_N tiles and a prefill query block in BLOCK_M tiles."""
        for prefix, k in self.kernels():
            if k.block_n is not None and page_size % k.block_n != 0:
                raise ConfigError(f"{prefix}.block_n={k.block_n} must divide kv.page_size={page_size}")
            if prefix.startswith("attn.prefill") and k.block_m is not None and self.q_block_size % k.block_m != 0:
                raise ConfigError(f"{prefix}.block_m={k.block_m} must divide attn.q_block_size={self.q_block_size}")


@dataclass
class KVConfig:
    page_size: int = 64
    memory_fraction: float = 0.9  # of the GPU memory left after weights; GPU only
    max_pages: Optional[int] = None  # fixes the pool size; default on the CPU: cpu_pages
    cpu_pages: int = 128
    # sliding layers keep only the pages inside their window, in a page group of their own
    reclaim_sliding: bool = True
    # reuse the KV of cached full prompt pages (same tokens, same prefix, same weights): a GRPO
    # group's prompt is prefilled once (docs/prefix-caching.md)
    prefix_cache: bool = True  # a GRPO group's prompt prefilled once (docs/prefix-caching.md)
    # GPU pool no bigger than what can be used at once: engine.max_batch_size sequences of
    # engine.max_model_len tokens, or fewer when the job's workload is known to need less
    fit_demand: bool = True

    def __post_init__(self):
        _check_pow2("kv.page_size", self.page_size, 8, 1024)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"kv.memory_fraction={self.memory_fraction} is invalid: allowed (0, 1]")
        if self.max_pages is not None and self.max_pages < 2:
            raise ConfigError(f"kv.max_pages={self.max_pages} is invalid: at least 2 (page 0 is the padding sink)")


@dataclass
class CudaGraphConfig:
    name: str = "auto"
    enabled: bool = True
    # null: derived from engine.max_batch_size (cuda_graphs.auto_buckets); a list fixes the ladder
    buckets: Optional[list[int]] = None

    def __post_init__(self):
        if self.buckets is None:  # derived from engine.max_batch_size at build
            return
        b = list(self.buckets)
        if self.enabled and (not b or any(x < 1 for x in b) or b != sorted(set(b))):
            raise ConfigError(f"cudagraph.buckets={b} is invalid: a strictly increasing list of positive batch sizes")


@dataclass
class EngineConfig:
    max_batch_size: int = 64
    max_model_len: int = 4096
    max_prefill_tokens: int = 8192  # token budget of one packed prefill step; long prompts are chunked
    # before the engine is returned, run every decode bucket and the prefill shapes a workload uses
    # (flexgemma/engine/warm.py), so nothing compiles or allocates inside a timed round
    warmup: bool = True
    compile: Optional[bool] = None  # torch.compile the fused norm/RoPE/activation glue and the sampler; null = GPU only
    # queue decode step N+1 before reading step N's tokens (host work overlaps the GPU; no sync a step)
    async_decode: bool = True  # measured on the H200: +10% on the E2B speed workload
    # sleep()/wake() between RL rollouts (vLLM: enable_sleep_mode): on a GPU the KV pool is mapped with
    # CUDA virtual memory so wake() maps it back at the same addresses and keeps the decode graphs
    # (engine/vmm.py); off, wake() re-captures the graphs when the caching allocator moved the pool
    sleep_mode: bool = False
    # a request's logprobs do not depend on what else runs, bit for bit: every product, the attention
    # and the log-probabilities through the kernels of flexgemma/model/invariant (docs/api.md says what
    # is invariant and what it costs)
    batch_invariant: bool = False

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size={self.max_batch_size} is invalid: at least 1")
        if self.max_model_len < 2:
            raise ConfigError(f"engine.max_model_len={self.max_model_len} is invalid: at least 2")
        if self.max_prefill_tokens < 16:
            raise ConfigError(f"engine.max_prefill_tokens={self.max_prefill_tokens} is invalid: at least 16")


@dataclass
class KernelsConfig:
    """Which implementation computes each part of a step (conf/kernels/default.yaml). Every choice
    computes the same maths (up to rounding); the defaults are what measured fastest on the H200
    (experiments/RESULTS.md). resolve.resolve_kernels decides each `auto` for the device and hands
    the result, a flexgemma.config.kernels.Kernels (this dataclass and the decode attention row counts), to
    the constructors. A new key: a field here with its check and its line in
    conf/kernels/default.yaml; resolve copies it over, and a constructor reads it from its Kernels."""

    # routed experts at decode: triton (model/moe_kernel.py: two kernels a step, no sort, bf16 or 4-bit
    # experts read packed, the router's top-k as one kernel; prefill-sized steps on torch's path),
    # grouped_mm (torch's sort + grouped GEMM), or auto (triton on a GPU)
    moe: str = "auto"
    # 4-bit projections (quant=bnb4): triton (model/linear4bit.py: the projections of one input as one
    # 4-bit matrix read packed by one kernel, an unmerged LoRA inside it), bnb (bitsandbytes' Linear4bit:
    # dequantise + GEMM per module), or auto (triton on a GPU)
    linear4bit: str = "auto"
    # one GEMM for q/k/v and one for gate/up (plain bf16/fp32 weights, concatenated at build)
    fuse_projections: bool = True
    # a layer's new K (norm + RoPE) and V (norm) written into the pools by one compiled function per
    # tensor instead of a norm kernel and an index_copy kernel each (a gain with the compiled glue only;
    # 31B bf16 at 64 on the H200, with its preset's decode tiles: 1,874 tok/s against 1,778)
    fused_kv_write: bool = False
    # prefill masks list the pages a query block passes wholly as full blocks, which the flex kernel
    # reads without the mask_mod (31B bf16's first 8,192-token prefill step on the H200: flex prefill
    # attention 175.4 -> 154.4 ms; the round at 64, 1,789 -> 1,795 tok/s)
    prefill_full_blocks: bool = True
    # how a prefill mask tells whether a query's sequence owns a listed page: table (the query's page-table
    # entry at the page's logical index, a gather per query and slot inside each partial tile) or owner (each
    # page's one owning row, a gather per slot; a step in which two rows list one page, a shared prompt
    # prefix, takes the table): the same mask either way; owner measured E2B's prefill 81.5k -> 84.3k tok/s
    prefill_page_check: str = "owner"
    # prefill attention: flex over the pool's pages, or varlen: torch's varlen_attn (FlashAttention) over each
    # chunk's keys gathered by slot (cached prefix and earlier chunks included), on the layers of head_dim <= 256
    # (wider ones keep flex); bf16/fp16 on a GPU, on the CPU the same mask through SDPA. Not the batch-invariant
    # mode's (its one kernel serves both phases). auto: varlen with the flex backend on an NVIDIA GPU (sm_80+)
    # and a bf16/fp16 model, flex elsewhere (E2B at 256 rows on an H100: prefill 97.1k -> 101.0k tok/s)
    prefill_attention: str = "auto"
    # 4-bit steps of more rows than this dequantise the group once and run one GEMM instead of the
    # Triton kernel (whose programs of 64 rows each decode their weights again): on the H200 the kernel
    # won at 64 rows and lost 1.2-4.4x at 128-512 on every group but E2B's small q/k/v (31B bnb4 at 128
    # rows: 1,335 tok/s with 64 against 991 with 512)
    linear4bit_max_rows: int = 64
    # how a 4-bit group dequantises (steps past linear4bit_max_rows, prefill): triton (one kernel,
    # 3.6-4.0 TB/s on 31B's groups on the H200; 31B bnb4 at 128 rows 1,354 -> 1,708 tok/s) or bnb
    # (bitsandbytes' op after torch decodes the 8-bit scales, 1.6-1.9 TB/s): the same weights bit for bit
    linear4bit_dequant: str = "triton"
    # MoE decode steps of more (token, choice) entries than this sort them by expert before the routed
    # kernels, so a program reads only its own; fewer are matched in every program (H200, one bf16
    # layer: matched 566 vs sorted 795 us at 64 rows; sorted 678-742 vs matched 732-943 at 128)
    moe_sort_above: int = 512
    # 4-bit experts at decode steps of more entries than this are dequantised into slots for the bf16
    # kernels instead of decoded inside them (H200, one 26B-A4B bnb4 layer: fused 1,086 vs slots 1,575
    # us at 128 rows, 1,886 vs 1,678 at 512)
    moe_fused_max_entries: int = 2048
    # how torch's path (prefill-sized steps) and the invariant experts dequantise 4-bit experts: bnb (a
    # gather, the scales decoded by torch, bitsandbytes' op) or triton (the slot kernel in one pass: 340
    # vs 658 us for 26B-A4B's 128 gate_up matrices on the H200, bit for bit; not yet timed through the engine)
    moe_dequant: str = "bnb"
    # the fused 4-bit expert kernels (decode steps; the invariant experts', see below) load each quantisation
    # block's bytes and scales one step ahead, so that a block's HBM load overlaps the previous block's
    # decode and products. H100, one 26B-A4B bnb4 layer: 474 -> 418 us at 8 rows, 847 -> 745 at 32, 1,071
    # -> 1,049 at 128; the bnb4 round at 128 3,164 -> 3,241 tok/s. The same products in the same order,
    # which the GPU's compiler rounds otherwise (1 bf16 ulp): each setting is batch-invariant, not the same
    # bits. The invariant experts prefetch only with invariant_4bit_subtiles=1 (their four-tile loop does
    # not, and a row must get the same bits from both loops)
    moe_4bit_prefetch: bool = True
    # decode steps of more (token, choice) entries than this run the fused 4-bit up kernel (prefetching) with
    # each decoded block as its products' first operand, 64 features a program, instead of the rows' tile:
    # the tensor cores' wide side on the weights. H100, 26B-A4B bnb4 at 128 rows (1,024 entries): 3,998 ->
    # 4,153 tok/s; one layer alone within noise at 64-128 rows, 4% slower at 32 (256 entries). Other
    # rounding (the products' order within a block); the invariant experts keep the rows-first form
    moe_4bit_weights_first_above: int = 512
    # how the fused 4-bit expert kernels turn a nibble into its code value: table (a load from the 16-entry
    # table per nibble, L1), select (a tree of selects over the entries held as scalars) or prmt (PTX prmt over
    # the table held in registers, four bytes at a time, NVIDIA GPUs only: model/ptx_lookup.py). The table's
    # own values every way, so the bits never change; speed only. auto: prmt on an NVIDIA GPU (H200,
    # experiment=rl_batch_26b_a4b quant=bnb4 at 128 rows: table 3,414 vs prmt 4,261 tok/s), table elsewhere
    moe_code_lookup: str = "auto"
    # engine.batch_invariant (model/invariant/): each sets a row's summation order, so each is part of the
    # result (any value is batch-invariant): the K elements a product sums before adding the next chunk,
    # the KV positions a decode program takes (prefill folds in the same chunks), the positions of one
    # attention tile (at most the page)
    invariant_k_chunk: int = 512
    invariant_split_tokens: int = 256
    invariant_block_n: int = 64
    # speed only (the bits are the same either way): an invariant product of fewer output tiles than this
    # runs a program per tile and K chunk, then sums the chunks in order (small row counts' parallelism; past
    # a third of an H100's SMs the partials' traffic costs more: E2B's invariant rl_batch_e2b on an H100,
    # 20,808 -> 23,599 tok/s at 256 rows and 10,714 -> 10,922 at 64 with 48 against 264)
    invariant_split_below_tiles: int = 48
    # speed only (the same bits): how a split product adds its chunks: kernel (a second kernel reads every
    # chunk's float32 partials) or last_program (the last of a tile's programs to finish, told by a counter
    # per tile, adds them: one launch fewer a product, 156 fewer an E2B decode step at 64 rows)
    invariant_split_sum: str = "kernel"
    # speed only (the same arithmetic): the invariant products' loop over K chunks written as one loop over
    # all K steps (each chunk's sum added to the total where it ends), and prefill attention's loop over KV
    # chunks as tl.range(flatten=True): one loop that Triton's pipeliner overlaps across chunks (a chunk of
    # 512 is 4-8 steps of 64-128: each chunk's loads otherwise start cold)
    invariant_flatten: bool = True
    # speed only (the same operations): how the products' blocks reach shared memory: pointers (a
    # masked load per element) or tma (tensor descriptors: the Hopper tensor memory accelerator moves each
    # block, out-of-range rows and K read as zeros as the masks give; products whose bases or row strides
    # are not 16-byte aligned take the pointers). auto: tma on NVIDIA sm_90 and newer (H100, E2B invariant
    # rl_batch_e2b: 10,778 -> 10,939 tok/s at 64 rows, 21,041 -> 21,689 at 256), pointers elsewhere
    invariant_loads: str = "auto"
    # the invariant routed experts: triton (model/moe_kernel.py's decode kernels for every step, in tiles
    # whose size does not change a row's bits, 4-bit experts decoded inside them: a decode step costs what
    # the default mode's does; bf16/fp16 models), grouped (each expert's rows through the invariant
    # product, 4-bit experts dequantised into slots every step), or auto (triton on a GPU); the two give
    # other bits
    invariant_experts: str = "auto"
    # invariant_experts=triton over 4-bit experts: 16-row tiles a program decodes each weight block for at
    # steps of at least 64 entries an expert (prefill, the trainer's forward): 4 (the block decoded once
    # for four tiles, each tile's operations those of one: the same bits, 25% less time a layer) or 1
    invariant_4bit_subtiles: int = 4
    # invariant_experts=triton over 4-bit experts, where a block's scale meets the products (other bits):
    # products (a block's float32 products times its scale: every step decoded inside the kernels in 16-row
    # tiles, whose bits change with the tile) or weights (its codes times the scale in the rows' dtype, the
    # arithmetic of dequantised weights: steps past moe_fused_max_entries run the bf16 kernels over the
    # routed experts dequantised that way, with tiles sized by the step, and give a row the fused bits)
    invariant_4bit_scale: str = "products"
    # task.trainer_forward=engine: vocabulary columns of one slice of the trainer's head (whole lane steps);
    # 0: as many as keep a [rows x slice] float32 block within 512 MiB (memory against launches)
    trainer_vocab_slice: int = 0
    # task.trainer_forward=engine, how the backward differentiates the glue's maths (norms, RoPE, gelu*up,
    # residual adds): eager (torch's ops one by one, each its own kernel) or compiled (the same functions
    # through torch.compile: each op's recomputed forward and its backward fused into a few kernels);
    # auto: compiled on a GPU, eager on the CPU (as engine.compile)
    trainer_glue_backward: str = "auto"
    # task.trainer_forward=engine, the dtype of the backward's attention, routed-expert and merged-adapter
    # factor maths: float32, or model_dtype (bf16 models: bf16 products with float32 accumulation, as
    # transformers' trainer and peft compute them)
    trainer_backward_dtype: str = "model_dtype"
    # task.trainer_forward=engine with checkpointed layers, what a layer's recomputation in the backward runs:
    # engine (the engine's kernels again: the first forward's activations bit for bit) or reference (torch's
    # products and the backward's reference maths; MoE layers stay on the engine's, whose router must pick
    # the experts it picked): its values feed only the gradients, which move by rounding; the logprobs are
    # the engine's either way
    trainer_recompute: str = "engine"

    def __post_init__(self):
        _check_choice("kernels.moe", self.moe, ("auto", "grouped_mm", "triton"))
        _check_pow2("kernels.invariant_k_chunk", self.invariant_k_chunk, 16, 1 << 16)
        _check_pow2("kernels.invariant_block_n", self.invariant_block_n, 16, 256)
        _check_pow2("kernels.invariant_split_tokens", self.invariant_split_tokens, self.invariant_block_n, 1 << 20)
        _check_choice("kernels.linear4bit", self.linear4bit, ("auto", "bnb", "triton"))
        _check_choice("kernels.prefill_page_check", self.prefill_page_check, ("table", "owner"))
        _check_choice("kernels.prefill_attention", self.prefill_attention, ("auto", "flex", "varlen"))
        _check_choice("kernels.linear4bit_dequant", self.linear4bit_dequant, ("bnb", "triton"))
        _check_choice("kernels.moe_dequant", self.moe_dequant, ("bnb", "triton"))
        _check_choice("kernels.moe_code_lookup", self.moe_code_lookup, ("auto", "table", "select", "prmt"))
        _check_choice("kernels.invariant_split_sum", self.invariant_split_sum, ("kernel", "last_program"))
        _check_choice("kernels.invariant_loads", self.invariant_loads, ("auto", "pointers", "tma"))
        _check_choice("kernels.invariant_experts", self.invariant_experts, ("auto", "grouped", "triton"))
        _check_choice("kernels.invariant_4bit_subtiles", self.invariant_4bit_subtiles, (1, 4))
        _check_choice("kernels.invariant_4bit_scale", self.invariant_4bit_scale, ("products", "weights"))
        _check_choice("kernels.trainer_glue_backward", self.trainer_glue_backward, ("auto", "eager", "compiled"))
        _check_choice("kernels.trainer_backward_dtype", self.trainer_backward_dtype, ("float32", "model_dtype"))
        _check_choice("kernels.trainer_recompute", self.trainer_recompute, ("engine", "reference"))
        for key in ("linear4bit_max_rows", "moe_sort_above", "moe_fused_max_entries", "moe_4bit_weights_first_above",
                    "invariant_split_below_tiles", "trainer_vocab_slice"):
            if getattr(self, key) < 0:
                raise ConfigError(f"kernels.{key}={getattr(self, key)} is invalid: at least 0")


@dataclass
class WorkloadConfig:
    name: str = "synthetic"
    num_prompts: Optional[int] = 16  # synthetic: how many; jsonl: at most this many from the file (null = all)
    min_prompt_len: int = 8
    max_prompt_len: int = 48
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = True
    seed: int = 1234
    rounds: int = 3
    warmup_rounds: int = 1
    path: Optional[str] = None  # prompts file for workload=jsonl
    n: int = 1  # completions per prompt (a GRPO group), each with its own seed

    def __post_init__(self):
        if (self.num_prompts is not None and self.num_prompts < 1) or self.max_new_tokens < 1 or self.n < 1:
            raise ConfigError("workload.num_prompts, workload.max_new_tokens and workload.n must be at least 1")
        if self.name == "jsonl" and not self.path:
            raise ConfigError("workload=jsonl needs the prompts file: workload.path=FILE.jsonl")
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise ConfigError(f"workload.rounds={self.rounds} / warmup_rounds={self.warmup_rounds}: need rounds >= 1, "
                              "warmup_rounds >= 0")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ConfigError(f"workload.min_prompt_len={self.min_prompt_len} / max_prompt_len={self.max_prompt_len}: "
                              "need 1 <= min <= max")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"workload.temperature={self.temperature} is invalid: allowed >= 0")


class TaskName(str, Enum):
    bench = "bench"
    parity = "parity"
    determinism = "determinism"
    drift = "drift"
    grpo = "grpo"
    all = "all"


@dataclass
class TaskConfig:
    name: TaskName = TaskName.bench
    max_prompts: int = 8  # parity: prompts compared against transformers generate (one at a time)
    # the summary metric the Hydra task function returns: what an Optuna sweep optimises
    objective: str = "throughput/output_tok_s_median"
    cycles: int = 10  # drift: perturb-and-refresh cycles before the original adapter is restored
    noise: float = 0.1  # drift: perturbation std, relative to each adapter tensor's RMS
    # grpo (flexgemma/tasks/grpo.py, docs/grpo.md): TRL's GRPOTrainer on the engine's LoRA adapter
    steps: int = 30  # optimizer steps (one rollout each)
    prompts_per_step: int = 4
    num_generations: int = 8  # completions per prompt (the group), each with its own seed
    max_new_tokens: int = 8
    temperature: float = 1.0  # the engine's logprobs are at temperature 1: the IS correction is exact there
    learning_rate: float = 1e-5
    beta: float = 0.0  # KL coefficient against the adapter-free base (0: no reference forward)
    loss_type: str = "dapo"  # TRL's loss types: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo
    reward: Any = None  # a Hydra node with _target_: a callable reward(prompts, completions, completion_ids, **cols)
    generator: str = "flexgemma"  # flexgemma (the engine) | trl (TRL's transformers generate, for the side-by-side)
    is_correction: bool = True  # token-level importance-sampling correction exp(trainer - engine), clipped
    is_clip_max: float = 3.0
    # recompute activations in the trainer's backward (less memory, more time); null: on with
    # trainer_forward=engine (its layers), off with transformers (TRL's gradient_checkpointing)
    gradient_checkpointing: Optional[bool] = None
    micro_batch: Optional[int] = None  # completions per backward (gradient accumulation); null: the whole step
    # the trainer's per-token logprobs: transformers (its Gemma-4 over peft's live adapters) or engine (the
    # engine's own forward and kernels with a backward, model/trainable.py; with engine.batch_invariant the
    # rollout's logprobs bit for bit: docs/grpo.md)
    trainer_forward: str = "transformers"
    # MoE models, trainer_forward=engine: the trainer routes each completion token to the experts the rollout
    # routed it to (R3, arXiv 2510.11370); grpo/router_flip_rate is logged either way
    routing_replay: bool = False
    # the trainer's logprobs behind the IS ratio and the mismatch metrics: separate (a no-grad forward after
    # each rollout, as TRL's vLLM path) or loss (the loss's own forward, one forward fewer a step: the same
    # weights, since each rollout trains one optimizer step); null: loss with trainer_forward=engine
    ratio_forward: Optional[str] = None
    # give the engine's KV cache back while the trainer computes (engine.sleep() after each rollout, wake()
    # before the next: TRL's vllm_enable_sleep_mode); the weights stay (the trainer shares them). On a GPU
    # pair it with engine.sleep_mode=true, which keeps the decode graphs' addresses valid across a wake
    engine_sleep: bool = False
    # grpo checkpoints (<job dir>/trainer/checkpoint-<step>: adapter, optimizer, scheduler, RNG, trainer state)
    save_every: int = 0  # a checkpoint every N optimizer steps (0: none)
    keep_checkpoints: int = 2  # the newest N are kept
    resume: Optional[bool] = None  # null: continue from the job dir's last checkpoint if any; true: must; false: refuse one

    def __post_init__(self):
        if self.name != TaskName.grpo:
            return
        for key in ("steps", "prompts_per_step", "num_generations", "max_new_tokens", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise ConfigError(f"task.{key}={getattr(self, key)} is invalid: task=grpo needs at least 1")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ConfigError(f"task.micro_batch={self.micro_batch} is invalid: at least 1, or null (the whole step)")
        if self.save_every < 0:
            raise ConfigError(f"task.save_every={self.save_every} is invalid: 0 (no checkpoints) or N >= 1 steps")
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = self.trainer_forward == "engine"
        if self.ratio_forward is None:
            self.ratio_forward = "loss" if self.trainer_forward == "engine" else "separate"
        if self.engine_sleep and str(getattr(self.generator, "value", self.generator)) != "flexgemma":
            raise ConfigError("task.engine_sleep=true frees the engine's KV cache between its rollouts: it needs "
                              "task.generator=flexgemma")
        if self.ratio_forward not in ("separate", "loss"):
            raise ConfigError(f"task.ratio_forward={self.ratio_forward!r} is invalid: separate or loss")
        if self.ratio_forward == "loss" and self.trainer_forward != "engine":
            raise ConfigError("task.ratio_forward=loss reads the IS ratio off the engine forward's loss pass: add "
                              "task.trainer_forward=engine engine.batch_invariant=true, or use task.ratio_forward=separate")


@dataclass
class LoggerConfig:
    kind: LoggerKind = LoggerKind.none
    project: str = "flexgemma"
    entity: Optional[str] = None  # the W&B team or user (null: wandb's default for this login)
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class PresetConfig:
    """Set by an experiment preset (conf/experiment/*.yaml): its name and the models it is written for
    (its KV pool, batch and workload are sized for them). Without model=..., a preset runs its first."""

    name: Optional[str] = None
    models: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    attn: AttnConfig = field(default_factory=AttnConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    cudagraph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    preset: PresetConfig = field(default_factory=PresetConfig)
    device: Device = Device.auto
    seed: int = 0  # engine seed for requests that bring none

    def __post_init__(self):
        """The rules that span groups (each group has checked itself already)."""
        eng, cg = self.engine, self.cudagraph
        if self.lora.merge and self.quant.method != "none":
            raise ConfigError(f"lora.merge=true needs bf16/fp32 base weights; with quant={self.quant.name} use "
                              "lora.merge=null/false")
        t = self.task
        if t.trainer_forward not in ("transformers", "engine"):
            raise ConfigError(f"task.trainer_forward={t.trainer_forward!r} is invalid: transformers or engine")
        if t.trainer_forward == "engine" and not eng.batch_invariant:
            raise ConfigError("task.trainer_forward=engine runs the engine's batch-invariant kernels in the trainer: "
                              "add engine.batch_invariant=true (or use task.trainer_forward=transformers)")
        if t.routing_replay and t.trainer_forward != "engine":
            raise ConfigError("task.routing_replay=true replays the rollout's experts in the engine's forward: add "
                              "task.trainer_forward=engine engine.batch_invariant=true")
        if t.trainer_forward == "engine" and t.beta:
            raise ConfigError(f"task.beta={t.beta} needs a reference forward without the adapter, which "
                              "task.trainer_forward=engine does not run: use task.beta=0 or task.trainer_forward=transformers")
        if t.trainer_forward == "engine" and self.kernels.fused_kv_write:
            raise ConfigError("task.trainer_forward=engine computes K and V unfused: set kernels.fused_kv_write=false")
        if cg.enabled and cg.buckets is not None and cg.buckets[-1] < eng.max_batch_size:
            raise ConfigError(
                f"cudagraph.buckets={list(cg.buckets)} has a hole: batches of {cg.buckets[-1] + 1}.."
                f"{eng.max_batch_size} (engine.max_batch_size) find no bucket; add {eng.max_batch_size} or lower "
                "engine.max_batch_size"
            )


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "lora": LoraConfig,
    "attn": AttnConfig,
    "kv": KVConfig,
    "cudagraph": CudaGraphConfig,
    "engine": EngineConfig,
    "kernels": KernelsConfig,
    "workload": WorkloadConfig,
    "task": TaskConfig,
    "logger": LoggerConfig,
}


# keys that moved or went away: the old spelling is refused with what to write instead (Hydra's own
# error would only say that the key is not in the struct)
MOVED_KEYS = {
    "engine.moe_kernel": "kernels.moe",
    "engine.linear4bit_kernel": "kernels.linear4bit",
    "engine.fuse_projections": "kernels.fuse_projections",
    "attn.fused_kv_write": "kernels.fused_kv_write",
}
REMOVED_KEYS = {
    "lora.dropout": "it was checked and never used: the engine generates without dropout, and a dropout in "
                    "the trainer's peft modules would reach the projections but not the experts (peft's "
                    "expert LoRA has none) nor the engine's samples; leave it out",
    "attn.kv_block_size": "a KV block of the BlockMask is one page of the cache: set kv.page_size",
}


def check_moved_keys(overrides) -> None:
    """Raises ConfigError for an override of a key that moved or went away, saying what to write."""
    for o in overrides:
        key, eq, value = str(o).partition("=")
        key = key.lstrip("+~")
        if eq and key in MOVED_KEYS:
            new = MOVED_KEYS[key]
            raise ConfigError(f"{key} moved to {new} (the kernels group): give {new}={value}")
        if eq and key in REMOVED_KEYS:
            raise ConfigError(f"{key} is no longer a key: {REMOVED_KEYS[key]}")


def short_dirname(name: str, limit: int = 120) -> str:
    """A sweep job's folder name: its overrides, cut with a digest of the rest when they are long
    (a folder name may have at most 255 bytes; a sweep over a preset with a few overrides exceeds it)."""
    name = str(name)
    if len(name) <= limit:
        return name
    return f"{name[:limit - 9]}~{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def name_suffix(name: Any) -> str:
    """`_NAME` for a sweep directory named after its experiment preset; "" without one."""
    return f"_{name}" if name not in (None, "", "None") else ""


# at import, not in register_configs: a launcher's job process resolves hydra.sweep.dir/subdir too
OmegaConf.register_new_resolver("fg_short", short_dirname, replace=True)
OmegaConf.register_new_resolver("fg_suffix", name_suffix, replace=True)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="flexgemma_schema", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _check_pow2(key: str, value: Optional[int], lo: int = 1, hi: int = 1 << 16) -> None:
    if value is not None and not (_is_pow2(value) and lo <= value <= hi):
        raise ConfigError(f"{key}={value} is invalid: it must be a power of two between {lo} and {hi}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is invalid: choose one of {', '.join(map(str, choices))}")


def _check_kernel(prefix: str, k: Any) -> None:
    _check_pow2(f"{prefix}.block_m", k.block_m, 16, 256)
    _check_pow2(f"{prefix}.block_n", k.block_n, 16, 256)
    _check_pow2(f"{prefix}.num_warps", k.num_warps, 1, 16)
    if k.num_stages is not None and not 1 <= k.num_stages <= 6:
        raise ConfigError(f"{prefix}.num_stages={k.num_stages} is invalid: allowed 1..6")


def _check_preset_model(cfg: DictConfig) -> None:
    preset = OmegaConf.select(cfg, "preset")
    if preset is None or not preset.models or OmegaConf.is_missing(cfg.model, "name"):
        return
    if cfg.model.name not in preset.models:
        models = ", ".join(preset.models)
        raise ConfigError(f"experiment={preset.name} is written for model={models.replace(', ', ' or model=')} "
                          f"(its KV pool, batch and workload are sized for it), not model={cfg.model.name}: "
                          f"give model={preset.models[0]}, or leave model= out and the preset picks it")


def validate(cfg: DictConfig) -> Config:
    """The composed config as typed dataclasses, made once: every group checks itself
    (`__post_init__`), then `Config` checks the rules across groups. Raises ConfigError naming the key."""
    from flexgemma.config.keys import config_problems

    _check_preset_model(cfg)
    unknown = config_problems(cfg, Config) if isinstance(cfg, DictConfig) else []
    if unknown:  # OmegaConf.to_object would drop them silently
        raise ConfigError("; ".join(unknown))
    return OmegaConf.to_object(cfg)


def validate_kernels(cfg) -> None:
    """Tile rules of the compiled flex kernels (see AttnConfig.check_tiles)."""
    attn = cfg.attn if isinstance(cfg.attn, AttnConfig) else OmegaConf.to_object(cfg.attn)
    attn.check_tiles(cfg.kv.page_size)
