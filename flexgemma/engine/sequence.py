"""A request's state: its tokens, pages, sampling parameters and why it finished."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import InitVar, dataclass, field
from typing import Any, Optional

import numpy as np

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
PENDING = -1  # the token of a queued decode step (engine.async_decode), until the host reads it


def is_int(x) -> bool:
    """A Python or numpy integer (numpy scalars count), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    """A Python or numpy int or float, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _int_problem(name: str, value, low: int, high: int, hint: str = "") -> Optional[str]:
    if not is_int(value):
        return f"{name}={value!r} must be an integer (got {type(value).__name__}){hint}"
    if not low <= value <= high:
        return f"{name}={value} must be in [{low}, {high}]{hint}"
    return None


DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    The same seed gives the same tokens whatever else shares the batch: the noise of each draw is
    a hash of (seed, position), not a stream shared by the batch. Numbers may be Python or numpy
    scalars. Invalid values raise ValueError here, naming each (as vLLM's SamplingParams does);
    `problems()` lists what is wrong with values changed since, `normalized()` returns plain Python
    values. `max_tokens` is vLLM's name for max_new_tokens (given both, they must agree).
    """

    max_new_tokens: Optional[int] = None  # None: max_tokens if given, else DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # completions of this prompt, each its own sequence with seed child_seed(seed, i)
    stop: tuple[str, ...] = ()  # strings that end a completion (needs a tokenizer); excluded from .text
    include_stop_str_in_output: bool = False
    # MoE models: each generated token's routed experts (uint8 [MoE layers, top-k]: the forward row that
    # produced the token), in RequestOutput.routed_experts (vLLM's / SGLang's return_routed_experts)
    return_routed_experts: bool = False
    max_tokens: InitVar[Optional[int]] = None  # vLLM's name for max_new_tokens

    def __post_init__(self, max_tokens: Optional[int]) -> None:
        if max_tokens is not None and self.max_new_tokens is not None and max_tokens != self.max_new_tokens:
            raise ValueError(f"invalid SamplingParams: max_tokens={max_tokens!r} and max_new_tokens="
                             f"{self.max_new_tokens!r} are the same setting (vLLM's name and flexgemma's): give one")
        if self.max_new_tokens is None:
            self.max_new_tokens = DEFAULT_MAX_NEW_TOKENS if max_tokens is None else max_tokens
        problems = self.problems()
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Everything wrong with these values (types, ranges, int64 bounds); empty when valid."""
        out = [
            _int_problem("max_new_tokens", self.max_new_tokens, 1, INT64_MAX),
            _int_problem("top_k", self.top_k, 0, INT64_MAX, " (0 disables it)"),
            None if self.seed is None else _int_problem("seed", self.seed, INT64_MIN, INT64_MAX, " (or None)"),
        ]
        t = self.temperature
        if not is_real(t) or not (math.isfinite(t) and 0 <= t <= FLOAT32_MAX):
            out.append(f"temperature={t!r} must be a finite number >= 0 (0 is greedy)")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must be a number in (0, 1] (1 disables it)")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            out.append(f"ignore_eos={self.ignore_eos!r} must be True or False")
        out.append(self._stop_problem())
        out.append(_int_problem("n", self.n, 1, 4096))
        out.append(_stop_strings_problem(self.stop))
        if not isinstance(self.include_stop_str_in_output, (bool, np.bool_)):
            out.append(f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be True or False")
        if not isinstance(self.return_routed_experts, (bool, np.bool_)):
            out.append(f"return_routed_experts={self.return_routed_experts!r} must be True or False")
        return [p for p in out if p]

    def _stop_problem(self) -> Optional[str]:
        ids = self.stop_token_ids
        if isinstance(ids, np.ndarray) and ids.ndim == 1:
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple, set, frozenset, range)):
            return f"stop_token_ids={ids!r} must be a list or tuple of token ids (ints; () for none)"
        bad = [t for t in ids if not is_int(t) or not 0 <= t <= INT64_MAX]
        if bad:
            return f"stop_token_ids holds {bad[0]!r}: every stop token must be an integer token id >= 0"
        return None

    def normalized(self) -> "SamplingParams":
        """A copy with plain Python values (numpy scalars converted); call only when problems() is empty."""
        ids = self.stop_token_ids.tolist() if isinstance(self.stop_token_ids, np.ndarray) else self.stop_token_ids
        return SamplingParams(
            max_new_tokens=int(self.max_new_tokens), temperature=float(self.temperature), top_k=int(self.top_k),
            top_p=float(self.top_p), seed=None if self.seed is None else int(self.seed),
            ignore_eos=bool(self.ignore_eos), stop_token_ids=tuple(int(t) for t in ids), n=int(self.n),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            return_routed_experts=bool(self.return_routed_experts),
        )


def _stop_strings_problem(stop) -> Optional[str]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
        return f"stop={stop!r} must be a list of non-empty strings (() for none)"
    return None


# vLLM's read-only alias (a property set after the dataclass made `max_tokens` an init-only argument)
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens, doc="vLLM's name for max_new_tokens")


def child_seed(seed: int, i: int) -> int:
    """The seed of completion i of a request seeded `seed` (n > 1): completion 0 keeps the request's
    seed (so n=1 is unchanged), the others add i times an odd 64-bit constant (distinct for every i)."""
    if i == 0:
        return seed
    return (seed + i * 0x9E3779B97F4A7C15) % (1 << 63)


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt


def is_prompt_dict(prompt) -> bool:
    """vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids} (a chat message has a role instead)."""
    return isinstance(prompt, dict) and any(k in prompt for k in PROMPT_KEYS)


def unwrap_prompt(prompt) -> tuple[Any, Optional[str]]:
    """(what a vLLM prompt dict holds: its text or token ids, None), or (None, why not); any other
    prompt as it is."""
    if not isinstance(prompt, dict):
        return prompt, None
    keys = sorted(prompt)
    if len(keys) == 1 and keys[0] in PROMPT_KEYS:
        value = prompt[keys[0]]
        if keys[0] == "prompt" and not isinstance(value, str):
            return None, f"prompt dict: 'prompt' must be a string (got {type(value).__name__})"
        return value, None
    return None, (f"a prompt dict holds one key, 'prompt' (text) or 'prompt_token_ids' (token ids), got {keys} "
                  "(chat messages are a list of {'role': ..., 'content': ...} dicts)")


def prompt_tokens(prompt) -> tuple[Optional[list[int]], Optional[str]]:
    """A prompt as a list of Python ints, or None and why not. Accepts a list or tuple of ints
    (numpy integers included), a 1-D integer numpy array or a 1-D integer torch tensor."""
    kind = type(prompt).__module__.split(".")[0]
    if kind in ("numpy", "torch") and hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):
        if prompt.ndim != 1:
            return None, f"prompt must be 1-D token ids, got an array of shape {tuple(prompt.shape)}"
        if kind == "torch":
            dtype = prompt.dtype
            integral = not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")
        else:
            integral = prompt.dtype.kind in "iu"
        if not integral:
            return None, f"prompt must hold integer token ids, got dtype {prompt.dtype}"
        return [int(t) for t in prompt.tolist()], None
    if not isinstance(prompt, (list, tuple)):
        return None, f"prompt must be a list of token ids (ints), got {type(prompt).__name__}"
    bad = next((t for t in prompt if not is_int(t)), None)
    if bad is not None:
        return None, f"prompt must be a list of token ids (ints), it holds {bad!r} ({type(bad).__name__})"
    return [int(t) for t in prompt], None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's name): RequestOutput.outputs holds n of them."""

    index: int  # which of the request's n completions (0..n-1)
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: Optional[str] = None  # the decoded tokens, when the engine has a tokenizer
    stop_reason: Optional[str] = None  # the stop string that ended it, if one did
    token_times: list[float] = field(default_factory=list)  # seconds after the request was added, a token each
    routed_experts: Optional[np.ndarray] = None  # uint8 [tokens, MoE layers, top-k] (return_routed_experts)

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class RequestOutput:
    """What generate() returns for one prompt (in prompt order), and step() for a finished request.

    `outputs` lists the request's n completions (SamplingParams.n); `token_ids`, `logprobs`,
    `finish_reason` and `text` are the first completion's (what n=1 callers read)."""

    index: int  # generate(): the prompt's position in the call; the step API: the request id
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token under the model (temperature 1, no filters)
    # "stop" (EOS / stop token) | "length" (max_new_tokens) | "max_model_len" | "error" | "abort"
    finish_reason: str
    error: Optional[str] = None
    num_preemptions: int = 0
    first_token_time: Optional[float] = None  # seconds after the request was added (generate(): started)
    finish_time: Optional[float] = None
    request_id: Optional[int] = None  # the id add_request() returned (None for an invalid request)
    outputs: list[CompletionOutput] = field(default_factory=list)
    text: Optional[str] = None  # outputs[0].text
    prompt: Optional[str] = None  # the prompt's text, when it was given as text or chat messages
    routed_experts: Optional[np.ndarray] = None  # outputs[0].routed_experts


@dataclass(frozen=True)
class StopRule:
    """When a sequence stops, besides its own max_new_tokens and stop tokens."""

    eos_token_ids: frozenset
    max_model_len: int

    def reason(self, s: "Sequence", tok: int, count: int) -> Optional[str]:
        """Why `s` stops after its `count`-th generated token `tok`, if it does."""
        if (not s.params.ignore_eos and tok in self.eos_token_ids) or tok in s.params.stop_token_ids:
            return "stop"
        if s.stop_matcher is not None and s.stop_matcher.matched(s.generated[:count]):
            return "stop"
        if count >= s.params.max_new_tokens:
            return "length"
        if len(s.prompt) + count >= self.max_model_len:
            return "max_model_len"
        return None


@dataclass
class Sequence:
    seq_id: int
    index: int  # reported as RequestOutput.index
    prompt: list[int]
    params: SamplingParams
    seed: int
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # pages of every position (logical page i at index i)
    window_pages: list = field(default_factory=list)  # sliding layers' own pages, None once out of the window
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    arrival: float = 0.0  # time.perf_counter() when it was added; the times above count from it
    token_times: list[float] = field(default_factory=list)  # when each generated token arrived (from arrival)
    request_id: Optional[int] = None  # the request it is a completion of (None: its own seq_id)
    sample_index: int = 0  # which of the request's n completions
    stop_matcher: object = None  # a text.StopMatcher when params.stop is set
    prompt_text: Optional[str] = None  # the prompt as text, when it was given as text or chat messages
    prefix_cacheable: bool = True  # may start from / register cached prompt pages (not engine.score's)
    block_hashes: Optional[tuple] = None  # (weight version, hashes of its full prompt pages), memoised
    tail_name: Optional[tuple] = None  # (weight version, its prompt's last-page name or None), memoised
    kv_version: Optional[int] = None  # the weight version its prompt KV was computed with
    routed: list = field(default_factory=list)  # per generated token its routed experts (return_routed_experts)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def needs_prefill(self) -> bool:
        """More than the last known token lacks KV (a new, chunked or preempted request).

        When only the last token lacks KV, a decode step computes it and samples the next one.
        """
        return self.num_computed < self.num_tokens - 1

    def routed_experts(self) -> Optional[np.ndarray]:
        if not self.params.return_routed_experts or not self.routed or self.routed[0] is None:
            return None
        return np.stack(self.routed)

    def to_completion(self) -> CompletionOutput:
        return CompletionOutput(self.sample_index, list(self.generated), list(self.logprobs),
                                self.finish_reason or "length", token_times=list(self.token_times),
                                routed_experts=self.routed_experts())

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            index=self.index,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.generated),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "length",
            num_preemptions=self.num_preemptions,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            request_id=self.seq_id if self.request_id is None else self.request_id,
            outputs=[self.to_completion()],
            routed_experts=self.routed_experts(),
        )
