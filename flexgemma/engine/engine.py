"""Engine.generate(): validate requests, run the step loop, collect outputs and timings."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq, Union

from tqdm.auto import tqdm

from flexgemma.engine.runner import ModelRunner
from flexgemma.engine.scheduler import Scheduler
from flexgemma.engine.sequence import RequestOutput, SamplingParams, Sequence, Status
from flexgemma.model.spec import ModelSpec

log = logging.getLogger("flexgemma")

PENDING = -1  # the token of a queued decode step, until the host reads it


class RequestError(ValueError):
    """Raised by generate(strict=True) when a request is invalid; lists every bad request."""


@dataclass
class StepStats:
    """Counters of the last generate() call (reset at each call)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    preemptions: int = 0
    decode_batch_sizes: list[int] = field(default_factory=list)
    kv_peak_pages: dict[str, int] = field(default_factory=dict)  # page group -> most pages in use at once
    chained_steps: int = 0  # async decode: steps queued before the previous step's tokens were read


class Engine:
    compile_counter = None  # a compiled.CompileCounter when the decode step is compiled
    # queue decode step N+1 (its input tokens taken on the device) before reading step N's tokens,
    # so the host's bookkeeping overlaps the GPU instead of stalling it once a step
    async_decode = False
    lora = None  # a model.lora.LoraAdapters when built with a LoRA adapter

    def __init__(self, model, spec: ModelSpec, runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 seed: int = 0, tokenizer=None, info: Optional[dict] = None):
        self.model = model  # the transformers Gemma4ForCausalLM whose weights the engine runs
        self.spec, self.runner, self.scheduler = spec, runner, scheduler
        self.max_model_len = max_model_len
        self.seed = seed
        self.tokenizer = tokenizer
        self.info = info or {}
        self.stats = StepStats()
        self._next_id = 0

    # -- LoRA --------------------------------------------------------------------------------------
    def update_lora(self, source, adapter_name: Optional[str] = None) -> dict:
        """Loads new adapter weights (a peft model, or a state dict with peft key names) and rebuilds
        the merged weights in place: the next generate() uses them, captured CUDA graphs included,
        without re-capture. Returns timings in ms (`refresh_ms` = copy + merge, synchronised)."""
        if self.lora is None:
            raise RuntimeError("this engine was built without a LoRA adapter (lora=none): build it with lora=r16 etc.")
        report = self.lora.update(source, adapter_name)
        log.debug("update_lora: %.2f ms (copy %.2f, merge %.2f)", report["refresh_ms"], report["copy_ms"],
                  report["merge_ms"])
        return report

    # -- validation --------------------------------------------------------------------------
    def request_problems(self, prompt, params: SamplingParams) -> list[str]:
        out = list(params.problems()) if isinstance(params, SamplingParams) else [f"not a SamplingParams: {params!r}"]
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            return out + ["prompt must be a list of token ids (ints)"]
        if len(prompt) == 0:
            out.append("empty prompt: give at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            out.append(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        if len(prompt) >= self.max_model_len:
            out.append(
                f"prompt of {len(prompt)} tokens leaves no room to generate: the maximum length is "
                f"{self.max_model_len} (engine.max_model_len), so prompts may have at most {self.max_model_len - 1}"
            )
        return out

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: Union[SamplingParams, Seq[SamplingParams], None] = None,
        use_tqdm: bool = False,
        strict: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in order.

        An invalid request (empty prompt, unknown token id, too long, bad sampling values) does not
        stop the others: its output has finish_reason "error" and `error` says what is wrong.
        With strict=True the call raises RequestError before generating anything instead.
        """
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        outputs: list[Optional[RequestOutput]] = [None] * len(prompts)
        seqs, problems = [], []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            errs = self.request_problems(prompt, sp)
            if errs:
                msg = f"request {i}: " + "; ".join(errs)
                problems.append(msg)
                outputs[i] = RequestOutput(i, list(prompt) if isinstance(prompt, (list, tuple)) else [], [], [],
                                           "error", error=msg)
                continue
            seed = sp.seed if sp.seed is not None else (self.seed * 1_000_003 + self._next_id) & 0x7FFFFFFF
            seqs.append(Sequence(self._next_id, i, list(prompt), sp, seed))
            self._next_id += 1
        if problems:
            if strict:
                raise RequestError("invalid requests (nothing was generated):\n  " + "\n  ".join(problems))
            for p in problems:
                log.warning("skipped %s", p)
        self.stats = StepStats()
        for g in self.runner.cache.page_groups:
            g.peak_in_use = g.in_use
            g.allocator.reset_order()
        start = time.perf_counter()
        for s in seqs:
            self.scheduler.add(s)
        bar = tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        generated = 0
        inflight = None  # an asynchronous decode step whose tokens are not read yet
        mark = start
        while self.scheduler.has_work or inflight is not None:
            if inflight is not None:
                # queue the next step before reading this one's tokens, when the batch stays the same
                nxt = self._launch(inflight.seqs, inflight) if self._can_chain(inflight.seqs) else None
                self.stats.chained_steps += nxt is not None
                tokens, logprobs = self.runner.collect(inflight)
                now = time.perf_counter()
                self._account_decode(len(inflight.seqs), now - mark)
                mark = now
                for s, i, tok, lp in zip(inflight.seqs, inflight.index, tokens, logprobs):
                    if s.status is Status.FINISHED:
                        continue  # finished by the step before: this row was computed in vain
                    s.generated[i], s.logprobs[i] = tok, lp
                    generated += 1
                    if not self._finish_if_done(s, i, now - start, outputs, bar):
                        self.scheduler.reclaim(s)
                inflight = nxt
                continue
            plan = self.scheduler.schedule()
            if not plan.seqs:
                stuck = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"request {stuck.index} ({stuck.num_tokens} tokens) cannot get KV pages even with nothing else "
                    f"running: the pool is too small for it (raise kv.max_pages or lower engine.max_prefill_tokens)"
                )
            if plan.kind == "decode" and self.async_decode:
                mark = time.perf_counter()
                inflight = self._launch(plan.seqs, None)
                continue
            t0 = time.perf_counter()
            tokens, logprobs = self.runner.run(plan)
            dt = time.perf_counter() - t0
            now = t0 + dt - start
            self._account(plan, dt)
            k = 0
            for i, s in enumerate(list(plan.seqs)):
                if plan.kind == "prefill":
                    samples = plan.samples(i)
                    s.num_computed += plan.chunk_lens[i]
                    self.scheduler.reclaim(s)
                    if not samples:
                        continue  # a chunk of a longer prompt
                else:
                    s.num_computed += 1
                    self.scheduler.reclaim(s)
                s.generated.append(tokens[k])
                s.logprobs.append(logprobs[k])
                k += 1
                generated += 1
                self._finish_if_done(s, len(s.generated) - 1, now, outputs, bar)
            if use_tqdm and dt > 0:
                bar.set_postfix(tok_s=f"{generated / max(now, 1e-9):.0f}", refresh=False)
        bar.close()
        self.stats.preemptions = sum(s.num_preemptions for s in seqs)
        self.stats.kv_peak_pages = {g.name: g.peak_in_use for g in self.runner.cache.page_groups}
        return outputs  # type: ignore[return-value]

    # -- asynchronous decode (engine.async_decode) ---------------------------------------------------
    def _launch(self, seqs: list[Sequence], chained):
        """Queues a decode step for `seqs` and gives each a placeholder token until it is read."""
        launch = self.runner.launch_decode(seqs, chained)
        for s in seqs:
            launch.index.append(len(s.generated))
            s.generated.append(PENDING)
            s.logprobs.append(float("nan"))
            s.num_computed += 1
        return launch

    def _can_chain(self, seqs: list[Sequence]) -> bool:
        """The next step is a decode of exactly these sequences: nothing waits to be admitted or
        prefilled, none reaches a known limit with the queued token, and pages are free for all."""
        sch = self.scheduler
        if sch.waiting or len(sch.running) != len(seqs):
            return False
        for s in seqs:
            if s.status is not Status.RUNNING or s.needs_prefill:
                return False
            if len(s.generated) >= s.params.max_new_tokens or s.num_tokens >= self.max_model_len:
                return False
        return all(sch.grow(s, s.num_tokens) for s in seqs)

    def _account_decode(self, batch: int, dt: float) -> None:
        st = self.stats
        st.decode_steps += 1
        st.decode_tokens += batch
        st.decode_time += dt
        st.decode_batch_sizes.append(batch)

    def _account(self, plan, dt: float) -> None:
        st = self.stats
        if plan.kind == "prefill":
            st.prefill_steps += 1
            st.prefill_tokens += plan.num_tokens
            st.prefill_time += dt
        else:
            st.decode_steps += 1
            st.decode_tokens += len(plan.seqs)
            st.decode_time += dt
            st.decode_batch_sizes.append(len(plan.seqs))

    def _finish_if_done(self, s: Sequence, i: int, now: float, outputs: list, bar) -> bool:
        """After s's token i arrived at `now` (s after start): finishes s if that token stops it
        (dropping a queued step's placeholder behind it). Returns whether s finished."""
        if s.first_token_time is None:
            s.first_token_time = now
        reason = self._finish_reason(s, s.generated[i], count=i + 1)
        if not reason:
            return False
        del s.generated[i + 1:], s.logprobs[i + 1:]
        s.finish_time = now
        self.scheduler.finish(s, reason)
        outputs[s.index] = s.to_output()
        bar.update(1)
        return True

    def _finish_reason(self, s: Sequence, tok: int, count: int) -> Optional[str]:
        """Why `s` stops after its `count`-th generated token `tok`, if it does."""
        if (not s.params.ignore_eos and tok in self.spec.eos_token_ids) or tok in s.params.stop_token_ids:
            return "stop"
        if count >= s.params.max_new_tokens:
            return "length"
        if len(s.prompt) + count >= self.max_model_len:
            return "max_model_len"
        return None
