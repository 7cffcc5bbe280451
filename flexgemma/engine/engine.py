"""The engine loop: requests in, one step at a time, finished outputs out.

    add_request(prompt, params) -> id     validate completely, queue a Sequence (nothing else)
    step() -> [RequestOutput]             schedule -> run -> postprocess; the outputs that finished
    generate(prompts, params)             add every request, step() while has_work, outputs in order

`Scheduler.schedule` decides each step (a packed prefill or a decode), `ModelRunner.run` computes it,
and `Scheduler.postprocess` is where sequence state (tokens, KV count, reclaim, finish) changes.
With engine.async_decode, a decode step is queued and read one step() later; `InflightDecode` owns
that step and queues the next decode of the same batch before reading it (the GPU never waits on
the host). Any exception or KeyboardInterrupt inside step() or generate() aborts the pending
requests and frees every page, so the engine stays usable; one lock serialises callers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq, Union

import torch
from tqdm.auto import tqdm

from flexgemma.engine.runner import DecodeLaunch, ModelRunner
from flexgemma.engine.scheduler import Scheduler, StepPlan
from flexgemma.engine.sequence import (RequestOutput, SamplingParams, Sequence, Status, StopRule, child_seed, is_int,
                                       is_prompt_dict, prompt_tokens, unwrap_prompt)
from flexgemma.engine.text import StopMatcher, completion_text, encode_prompt, is_chat, is_text_prompt, prompt_text
from flexgemma.model.spec import ModelSpec
from flexgemma.model.watch import WeightWatch

log = logging.getLogger("flexgemma")


class RequestError(ValueError):
    """An invalid request: raised by add_request(), and by generate(strict=True) listing every bad one."""


@dataclass
class StepStats:
    """Counters of the last generate() call (reset at each call; step() adds to them)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    preemptions: int = 0
    decode_batch_sizes: list[int] = field(default_factory=list)
    kv_peak_pages: dict[str, int] = field(default_factory=dict)  # page group -> most pages in use at once
    kv_prompt_peak_pages: dict[str, float] = field(default_factory=dict)  # prompt tokens' KV, in pages
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    shared_pages_peak: int = 0  # most pages held by more than one sequence at once (every page group)
    chained_steps: int = 0  # async decode: steps queued before the previous step's tokens were read
    # async decode on a GPU: the GPU's seconds in decode steps, and idle between a step and the next
    # one chained to it (time the host took to queue it: a host-bound loop shows here)
    gpu_decode_steps: int = 0
    gpu_decode_busy: float = 0.0
    gpu_decode_idle: float = 0.0

    def add_gpu_decode(self, busy: float, idle: Optional[float]) -> None:
        self.gpu_decode_steps += 1
        self.gpu_decode_busy += busy
        self.gpu_decode_idle += idle or 0.0

    def add_decode(self, batch: int, dt: float) -> None:
        self.decode_steps += 1
        self.decode_tokens += batch
        self.decode_time += dt
        self.decode_batch_sizes.append(batch)

    def add_step(self, plan: StepPlan, dt: float) -> None:
        if plan.kind == "decode":
            return self.add_decode(len(plan.seqs), dt)
        self.prefill_steps += 1
        self.prefill_tokens += plan.num_tokens
        self.prefill_time += dt


class InflightDecode:
    """engine.async_decode: owns the decode step that is queued on the device but not read yet.

    `advance` queues the next decode of the same batch (when nothing else must run first and
    pages are free) before reading this one's tokens, so the host's bookkeeping overlaps the GPU."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler
        self.step: Optional[DecodeLaunch] = None
        self.mark = 0.0  # when the time of the step in flight started counting
        self.prev_end = None  # the GPU end event of the step before the one in flight, when chained

    def launch(self, seqs: list[Sequence]) -> None:
        self.mark = time.perf_counter()
        self.prev_end = None  # other work (a prefill) may have run since the last decode step
        self.step = self._queue(seqs, None)

    def _queue(self, seqs: list[Sequence], chained: Optional[DecodeLaunch]) -> DecodeLaunch:
        launch = self.runner.launch_decode(seqs, chained)
        launch.index = self.scheduler.launched(seqs)
        return launch

    def advance(self, stats: StepStats) -> list[Sequence]:
        """Reads the step in flight (queuing the next first when it can); returns who finished."""
        cur, sch = self.step, self.scheduler
        chain = sch.can_chain(cur.seqs) and sch.grow_for_decode(cur.seqs)
        self.step = self._queue(cur.seqs, cur) if chain else None
        stats.chained_steps += chain
        tokens, logprobs, routed = self.runner.collect(cur)
        now = time.perf_counter()
        stats.add_decode(len(cur.seqs), now - self.mark)
        if cur.events is not None:  # both have passed: cur's tokens are read
            start, end = cur.events
            idle = self.prev_end.elapsed_time(start) / 1e3 if self.prev_end is not None else None
            stats.add_gpu_decode(start.elapsed_time(end) / 1e3, idle)
            self.prev_end = end if chain else None
        self.mark = now
        return sch.postprocess_launched(cur.seqs, cur.index, tokens, logprobs, now, routed)

    def drop(self) -> None:
        """Forgets the step in flight after a failure, once the device has finished it."""
        self.step = None
        if self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception as e:  # the failure itself may be the device's: report, keep cleaning up
                log.warning("async decode: the dropped step's device work failed: %s", e)


class Engine:
    """Generation over a paged KV cache. generate(), step(), add_request(), abort() and
    update_lora() take one lock: a second thread calling any of them waits until the first
    call returns (generate() holds it for its whole call), so outputs are never mixed.
    generate() needs an idle engine: it refuses to start while step-API requests are pending."""

    compile_counter = None  # a compiled.CompileCounter when the decode step is compiled
    # queue decode step N+1 (its input tokens taken on the device) before reading step N's tokens,
    # so the host's bookkeeping overlaps the GPU instead of stalling it once a step
    async_decode = False
    lora = None  # a model.lora.LoraAdapters when built with a LoRA adapter

    def __init__(self, model, spec: ModelSpec, runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 seed: int = 0, tokenizer=None, info: Optional[dict] = None, lora=None):
        self.model = model  # the transformers Gemma4ForCausalLM whose weights the engine runs
        self.spec, self.runner, self.scheduler = spec, runner, scheduler
        scheduler.stop_rule = StopRule(frozenset(spec.eos_token_ids), max_model_len)
        self.max_model_len = max_model_len
        self.seed = seed
        self.tokenizer = tokenizer
        self.info = info or {}
        self.stats = StepStats()
        self._next_id = 0
        self._requests: dict[int, list[Sequence]] = {}  # pending requests by id: their n completions
        self.asleep = False  # sleep() released the KV pool; wake() restores it
        self._inflight = InflightDecode(runner, scheduler)
        self._lock = threading.RLock()
        self.lora = lora
        # every parameter the forward reads, to notice changes the caller makes (model/watch.py)
        self._watch = WeightWatch(model, lora) if model is not None else None

    # Engine.from_model(hf_model, tokenizer=None, **overrides) is flexgemma.api.engine_from_model,
    # attached in flexgemma/__init__.py: the engine imports nothing that builds engines (no cycle).

    # -- LoRA --------------------------------------------------------------------------------------
    def update_lora(self, source, adapter_name: Optional[str] = None) -> dict:
        """Loads new adapter weights (a peft model, or a state dict with peft key names) and rebuilds
        the merged weights in place: the next generate() uses them, captured CUDA graphs included,
        without re-capture. Returns timings in ms (`refresh_ms` = copy + merge, synchronised)."""
        if self.lora is None:
            raise RuntimeError("this engine was built without a LoRA adapter (lora=none): build it with lora=r16 etc.")
        with self._lock:  # never between two steps of a generate() in another thread
            self._notice_weight_changes(refresh_factors=False)  # the caller's own changes first; the update refreshes
            try:
                report = self.lora.update(source, adapter_name)
            finally:  # a failed update restored the previous adapter; either way the merges are the engine's own
                self._watch.rebaseline()
                self.weights_changed()
        log.debug("update_lora: %.2f ms (copy %.2f, merge %.2f)", report["refresh_ms"], report["copy_ms"],
                  report["merge_ms"])
        return report

    def weights_changed(self) -> None:
        """Call after changing the weights the forward reads where the engine cannot see it (a change
        through `.data` of a few elements; update_lora and every other change are seen by
        themselves: model/watch.py): the prefix cache forgets every page, and no page computed with
        the old weights is ever a hit again."""
        with self._lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.bump_version()

    def _notice_weight_changes(self, refresh_factors: bool = True) -> None:
        """Before admitting requests (generate, add_request) and before a step that may prefill a
        queued one: takes every change to the model's parameters since the last look (in place,
        through `.data`, or a replaced Parameter: re-fused into the storage the forward and CUDA
        graphs read), or refuses one it cannot take (WeightError naming the parameter); a change
        counts as weights_changed(), so no cached page of the old weights is ever served."""
        if self._watch is not None and self._watch.check(refresh_factors):
            self.weights_changed()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt page (e.g. before a timed round that must compute its prompts)."""
        with self._lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.clear()

    # -- scoring, sleep / wake ---------------------------------------------------------------------
    def score(self, sequences, prompt_lens, top_k: int = 0, return_routed_experts: bool = False) -> list:
        """Teacher-forced log-probabilities: for each token sequence, the log-probability of each of
        its tokens from prompt_lens[i] on given the tokens before it (and, with top_k > 0, the
        top_k most likely tokens at each of those positions; with return_routed_experts, on MoE models,
        the experts each scoring row routed to), through the engine's own batched, paged prefill.
        Returns a score.ScoreOutput per sequence, in order. Needs an idle engine."""
        from flexgemma.engine.score import run_score, score_problems

        with self._lock:
            self._require_awake()
            self._require_idle("score()")
            tokens, prompt_lens, errs = score_problems(self, sequences, prompt_lens)
            if not (is_int(top_k) and 0 <= top_k <= self.spec.vocab_size):
                errs.append(f"top_k={top_k!r} must be an int in [0, {self.spec.vocab_size}]")
            if errs:
                raise RequestError("invalid score() call (nothing was run): " + "; ".join(errs))
            return run_score(self, tokens, [int(p) for p in prompt_lens], int(top_k), bool(return_routed_experts))

    def sleep(self, level: int = 1) -> dict:
        """Releases the KV pool's memory (weights and the decode graphs stay); until wake(),
        generate/step/score raise. Needs an idle engine. Returns kv_pool_bytes and freed_bytes
        (on a GPU: memory_reserved before minus after, cached blocks emptied).

        level: vLLM's argument; 1 is the only level here. vLLM's level 1 also moves the weights to
        the CPU; here they stay, because a trainer in the same process works on them."""
        from flexgemma.engine.sleep import release

        if level != 1:
            raise ValueError(f"sleep(level={level!r}): only level=1 (release the KV cache; the weights stay, shared "
                             "with the trainer): vLLM's level 2 discards the weights, which the trainer still needs")
        with self._lock:
            self._require_awake()
            self._require_idle("sleep()")
            self.reset_prefix_cache()  # the pool's contents are lost
            self._slept = release(self.runner)
            self.asleep = True
            return {k: v for k, v in self._slept.items() if k != "addresses"}

    def wake(self) -> dict:
        """Re-allocates the KV pool; the decode graphs are kept when the pool landed at its old
        addresses, else captured again (engine/sleep.py). Returns {"seconds", "recaptured"}. The
        same requests then give the same tokens as before sleep()."""
        from flexgemma.engine.sleep import restore

        with self._lock:
            if not self.asleep:
                raise RuntimeError("wake(): the engine is not asleep (call sleep() first)")
            report = restore(self.runner, self._slept)
            self.asleep = False
            self.info["wake_seconds"], self.info["wake_recaptured"] = report["seconds"], report["recaptured"]
            return report

    def wake_up(self, tags: Optional[list[str]] = None) -> dict:
        """vLLM's name for wake(). tags: vLLM's ["weights", "kv_cache"]; the weights never leave (see
        sleep), so only "kv_cache" (or no tags) wakes the engine, and ["weights"] alone does nothing."""
        allowed = {"weights", "kv_cache"}
        if tags is not None and (isinstance(tags, str) or not set(tags) <= allowed):
            raise ValueError(f"wake_up(tags={tags!r}): a list of {sorted(allowed)}, or None for both")
        if tags is not None and "kv_cache" not in tags:
            return {"seconds": 0.0, "recaptured": False}
        return self.wake()

    def _require_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("the engine is asleep (sleep() released its KV pool): call engine.wake() first")

    def _require_idle(self, what: str) -> None:
        if self._requests or self.has_work:
            raise RuntimeError(f"{what} needs an idle engine, but {len(self._requests)} requests added with "
                               f"add_request() are pending: step() until has_work is False, or abort() them")

    # -- validation --------------------------------------------------------------------------
    def request_problems(self, prompt, params: SamplingParams) -> list[str]:
        """Everything wrong with one request (empty when it is valid)."""
        return self._check(prompt, params)[2]

    def _check(self, prompt, params) -> tuple[Optional[list[int]], Optional[SamplingParams], list[str]]:
        """(prompt as ints, params with plain Python values, problems): the request as it will run."""
        if params is None:
            params = SamplingParams()
        prompt, err = unwrap_prompt(prompt)
        if err:
            return None, None, [err]
        errs = params.problems() if isinstance(params, SamplingParams) else [f"not a SamplingParams: {params!r}"]
        if isinstance(params, SamplingParams) and params.stop and self.tokenizer is None:
            errs.append("stop strings need a tokenizer (model.path with tokenizer.json): use stop_token_ids")
        tokens, err = encode_prompt(self.tokenizer, prompt) if is_text_prompt(prompt) else prompt_tokens(prompt)
        if err:
            return None, None, errs + [err]
        if len(tokens) == 0:
            errs.append("empty prompt: give at least one token (e.g. BOS)")
        vocab = self.spec.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            errs.append(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            errs.append(
                f"prompt of {len(tokens)} tokens leaves no room to generate: the maximum length is "
                f"{self.max_model_len} (engine.max_model_len), so prompts may have at most {self.max_model_len - 1}"
            )
        if errs:
            return tokens, None, errs
        params = params.normalized()
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            return tokens, None, [f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})"]
        return tokens, params, []

    # -- the step API ----------------------------------------------------------------------------
    @property
    def tokens_generated(self) -> int:
        """Tokens generated since the engine was built (read-only; a progress bar polls it)."""
        return self.scheduler.tokens_generated

    @property
    def has_work(self) -> bool:
        """Some request is still pending (waiting, running, or in a queued decode step)."""
        return self.scheduler.has_work or self._inflight.step is not None

    def add_request(self, prompt, params: Optional[SamplingParams] = None) -> int:
        """Queues one request; returns its id. An invalid request raises RequestError and queues
        nothing. Its output comes from the step() in which it finishes."""
        with self._lock:
            self._require_awake()
            tokens, params, errs = self._check(prompt, params)
            if errs:
                raise RequestError("invalid request (nothing was queued): " + "; ".join(errs))
            self._notice_weight_changes()
            return self._add(tokens, params, text=prompt_text(self.tokenizer, unwrap_prompt(prompt)[0]))

    def _add(self, tokens: list[int], params: SamplingParams, index: Optional[int] = None,
             text: Optional[str] = None) -> int:
        """Queues the request's n completions as adjacent sequences (scheduled together); its id is
        the first one's seq_id. Completion i draws with child_seed(request seed, i)."""
        rid = self._next_id
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + rid) & 0x7FFFFFFF
        now = time.perf_counter()
        group = []
        for i in range(params.n):
            seq = Sequence(rid + i, rid if index is None else index, tokens, params, child_seed(seed, i),
                           arrival=now, request_id=rid, sample_index=i, prompt_text=text)
            if params.stop:
                seq.stop_matcher = StopMatcher(self.tokenizer, params.stop)
            group.append(seq)
        self._next_id += params.n
        self._requests[rid] = group
        for seq in group:
            self.scheduler.add(seq)
        return rid

    def _finished_outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests all of whose completions have finished."""
        outs = []
        for s in finished:
            group = self._requests.get(s.request_id)
            if group is not None and all(c.status is Status.FINISHED for c in group):
                del self._requests[s.request_id]
                outs.append(self._output(group))
        return outs

    def _output(self, group: list[Sequence]) -> RequestOutput:
        out = group[0].to_output()
        out.outputs = [s.to_completion() for s in group]
        if self.tokenizer is not None:
            out.outputs = [completion_text(self.tokenizer, s, c) for s, c in zip(group, out.outputs)]
            out.text = out.outputs[0].text
        out.prompt = group[0].prompt_text
        out.num_preemptions = sum(s.num_preemptions for s in group)
        times = [s.finish_time for s in group if s.finish_time is not None]
        out.finish_time = max(times) if times else None
        return out

    def step(self) -> list[RequestOutput]:
        """Runs one step (a prefill, a decode, or reading a queued decode); returns the outputs of
        the requests that finished in it. If it raises (or is interrupted), every pending request
        is aborted and every page freed before the exception propagates: the engine stays usable."""
        with self._lock:
            return self._step(admitting=True)

    def _step(self, admitting: bool) -> list[RequestOutput]:
        """step(); `admitting`: a queued request may be prefilled, so the weights are looked at first
        (generate() looked before queuing its requests and holds the lock: nothing changed since)."""
        try:
            self._require_awake()
            if admitting and self.scheduler.waiting:  # never prefill from pages of weights changed since add_request
                self._notice_weight_changes()
            return self._finished_outputs(self._run_step())
        except BaseException:
            self._abort_all()
            raise

    def _run_step(self) -> list[Sequence]:
        if self._inflight.step is not None:
            return self._inflight.advance(self.stats)
        if not self.scheduler.has_work:
            return []
        plan = self.scheduler.schedule()
        if plan.kind == "decode" and self.async_decode:
            self._inflight.launch(plan.seqs)
            return []
        t0 = time.perf_counter()
        tokens, logprobs, routed = self.runner.run(plan)
        now = time.perf_counter()
        self.stats.add_step(plan, now - t0)
        return self.scheduler.postprocess(plan, tokens, logprobs, now, routed)

    def abort(self, request_id: int) -> Optional[RequestOutput]:
        """Stops a pending request and frees its pages. Returns its output (finish_reason "abort",
        with the tokens it had), or None when it already finished; an id never issued is a KeyError."""
        with self._lock:
            group = self._requests.pop(request_id, None)
            if group is None:
                if is_int(request_id) and 0 <= request_id < self._next_id:
                    return None
                raise KeyError(f"no request with id {request_id!r}: ids are what add_request() returned")
            for seq in group:
                if seq.status is not Status.FINISHED:
                    self.scheduler.abort(seq)
            return self._output(group)

    def _abort_all(self) -> None:
        """After a failure: drops the step in flight, aborts every pending request, frees every page."""
        self._inflight.drop()
        self.scheduler.abort_all([s for group in self._requests.values() for s in group])
        self._requests.clear()

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 use_tqdm: bool = False, strict: bool = False) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in order.

        A prompt is a list of token ids, a string or a list of chat messages (with a tokenizer), or
        vLLM's {"prompt_token_ids": [...]} / {"prompt": "..."}; one prompt alone (e.g. [2, 18, 279])
        is a call of one.

        An invalid request (empty prompt, unknown token id, too long, bad sampling values) does not
        stop the others: its output has finish_reason "error" and `error` says what is wrong.
        With strict=True the call raises RequestError before generating anything instead. A call
        that raises or is interrupted leaves no trace: its requests are aborted, their pages freed.
        """
        with self._lock:
            self._require_awake()
            outputs, accepted = self._validate_call(prompts, params, strict)
            first_id = self._begin_call()
            self._notice_weight_changes()
            bar = tqdm(total=len(accepted), desc="generate", unit="req", disable=not use_tqdm, leave=False)
            try:
                for i, tokens, sp, text in accepted:
                    self._add(tokens, sp, index=i, text=text)
                while self.has_work:
                    for out in self._step(admitting=False):
                        outputs[out.index] = out
                        bar.update(1)
                    self._show_rate(bar)
            except BaseException:
                self._abort_all()
                self._next_id = first_id  # request ids pick default seeds: the next call's are as if this one never ran
                raise
            finally:
                bar.close()
            self._end_call(outputs)
            return outputs

    def _show_rate(self, bar) -> None:
        if not bar.disable:
            rate = self.stats.decode_tokens / max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)

    def _validate_call(self, prompts, params, strict: bool) -> tuple[list, list]:
        """Checks every request of a generate() call before any is queued. Returns the outputs
        list (invalid requests' error outputs filled in) and the accepted (index, tokens, params)."""
        prompts = one_or_many(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        outputs: list[Optional[RequestOutput]] = [None] * len(prompts)
        accepted, problems = [], []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            tokens, sp, errs = self._check(prompt, sp)
            if not errs:
                accepted.append((i, tokens, sp, prompt_text(self.tokenizer, unwrap_prompt(prompt)[0])))
                continue
            msg = f"request {i}: " + "; ".join(errs)
            problems.append(msg)
            shown = list(prompt) if isinstance(prompt, (list, tuple)) and not is_chat(prompt) else tokens or []
            outputs[i] = RequestOutput(i, shown, [], [], "error", error=msg)
        if problems and strict:
            raise RequestError("invalid requests (nothing was generated):\n  " + "\n  ".join(problems))
        for p in problems:
            log.warning("skipped %s", p)
        return outputs, accepted

    def _begin_call(self) -> int:
        """Fresh counters for a generate() call; returns the first request id it will use."""
        if self._requests:
            raise RuntimeError(f"generate() needs an idle engine, but {len(self._requests)} requests added with "
                               f"add_request() are pending: step() until has_work is False, or abort() them")
        self.stats = StepStats()
        self.scheduler.reset_peaks()
        return self._next_id

    def _end_call(self, outputs: list[RequestOutput]) -> None:
        self.stats.preemptions = sum(o.num_preemptions for o in outputs)
        self.stats.kv_peak_pages = self.scheduler.peak_pages()
        self.stats.kv_prompt_peak_pages = dict(self.scheduler.prompt_pages_peak)
        self.stats.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        self.stats.shared_pages_peak = self.scheduler.shared_pages_peak


def one_or_many(prompts) -> list:
    """generate()'s prompts as a list: one prompt (a flat list of token ids, a string, a vLLM prompt
    dict) becomes a list of one, as in vLLM; a list of chat messages is one conversation, refused
    with how to pass it (messages alone are ambiguous with a list of prompt dicts)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not hasattr(prompts, "__iter__") or isinstance(prompts, bytes):
        raise RequestError(f"prompts must be a list of prompts (token-id lists, strings, chat message lists or "
                           f"{{'prompt_token_ids': [...]}} dicts) or one prompt, got {type(prompts).__name__}")
    if is_chat(prompts) and not any(is_prompt_dict(p) for p in prompts):
        raise RequestError("prompts is one conversation (a list of messages): wrap it in a list, "
                           "generate([messages])")
    prompts = list(prompts)
    if prompts and all(is_int(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
