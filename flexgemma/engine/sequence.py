"""A request's state: its tokens, pages, sampling parameters and why it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    The same seed gives the same tokens whatever else shares the batch: the noise of each draw is
    a hash of (seed, position), not a stream shared by the batch.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            out.append(f"max_new_tokens={self.max_new_tokens} must be an integer >= 1")
        if not self.temperature >= 0:
            out.append(f"temperature={self.temperature} must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k={self.top_k} must be an integer >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p} must be in (0, 1]")
        return out


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What generate() returns for one prompt, in prompt order."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token under the model (temperature 1, no filters)
    finish_reason: str  # "stop" (EOS / stop token) | "length" (max_new_tokens) | "max_model_len" | "error"
    error: Optional[str] = None
    num_preemptions: int = 0
    first_token_time: Optional[float] = None  # seconds after generate() started
    finish_time: Optional[float] = None


@dataclass
class Sequence:
    seq_id: int
    index: int  # position in the generate() call
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
        )
