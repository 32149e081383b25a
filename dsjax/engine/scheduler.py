"""Continuous batching: keep up to `num_slots` sequences in flight and refill a finished slot at once.

`run` takes requests in order and yields every generated token as it is produced, so callers can
stream tokens into their own output processing; a short request never waits for a long one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator

import jax
import numpy as np

from dsjax.engine import speculative
from dsjax.engine.acceptance import Acceptance
from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine, Spliced
from dsjax.engine.grammar import MaskFiller, Matcher
from dsjax.engine.thinking_budget import ThinkingBudget
from dsjax.engine.sampling import Sampled, SamplingArrays, SamplingParams

_IDLE = SamplingParams(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    # Embeddings that replace the prompt's at some positions (an image's, at its placeholders).
    spliced: Spliced | None = None
    # The grammar its tokens must follow (constrained decoding) or its thinking budget, advanced here as tokens are
    # emitted.
    matcher: Matcher | ThinkingBudget | None = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of request `index`; `finish_reason` is set on its last token."""

    index: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] | None
    finish_reason: str | None = None


class _Slots:
    """Host-side view of what each slot holds."""

    def __init__(self, n: int, max_len: int):
        self.max_len = max_len
        self._sampling = None  # (requests, SamplingArrays) of the last call
        self.request: list[Request | None] = [None] * n
        self.total = [0] * n  # tokens in the sequence, prompt + generated
        self.generated = [0] * n
        self.last = [0] * n

    def ends_by_count(self, s: int, one_more: bool) -> bool:
        """Whether slot s's request has (or, with `one_more` token in flight, will have) all the tokens
        its max_tokens or the cache's max_len allow."""
        extra = int(one_more)
        return (self.generated[s] + extra >= self.request[s].sampling.max_tokens
                or self.total[s] + extra >= self.max_len)

    def sampling(self) -> SamplingArrays:
        """Every slot's sampling row; the modes are what the slots' requests need (each mix has its
        sampler program, `Engine.precompile`)."""
        reqs = tuple(self.request)
        # Rebuilt only when the slots' requests change, not on every decode step.
        last = self._sampling[0] if self._sampling else ()
        if len(last) != len(reqs) or any(a is not b for a, b in zip(last, reqs)):
            arrays = SamplingArrays.of([r.sampling if r else _IDLE for r in reqs], [r.seed if r else 0 for r in reqs])
            self._sampling = (reqs, arrays)
        return self._sampling[1]


def run(engine: Engine, requests: Iterable[Request], cancelled: set[int] | None = None,
        timer: "StepTimer | None" = None, acceptance: Acceptance | None = None) -> Iterator[TokenEvent]:
    """Generate for every request, yielding tokens as they come (requests interleave).

    A consumer that adds a request's index to `cancelled` while handling one of its tokens ends that
    request there (its slot is refilled); `timer`, if given, accumulates the time spent in the steps.

    Decode steps are pipelined: step t+1 is dispatched, fed step t's tokens on the device, before the
    host reads step t's tokens and yields their events, so the device does not wait for the host
    between steps. A slot whose request a read then ends (a stop token, a cancellation) has already
    run one more step; that token is dropped. Slots that end by length are never run past it.

    An engine that drafts (`Engine.drafting`) runs verification steps instead, each emitting one or more tokens
    per slot: the tokens each slot may still emit live on the device (`DraftState.budget`), so a step never
    runs a slot past its length, and tokens after a stop token are dropped. The width of each step comes
    from the confidences of the drafts read last (`Engine.width_for`: the step in flight was dispatched before
    they were read). `acceptance`, if given, counts what the verification kept.

    A step with a constrained request in it (`Request.matcher`) dispatches the model, reads the step before it
    (advancing the matchers) while the device runs the model, starts the token masks on another thread (which
    also copies them to the device), yields the tokens it read while the masks are made, then samples with the
    masks: the masks are made while the device runs the model and the consumer handles tokens. Constrained
    requests do not combine with drafting.
    """
    cancelled = set() if cancelled is None else cancelled
    timer = timer or StepTimer()
    n = engine.num_slots
    slots = _Slots(n, engine.max_len)
    cache = None  # made at the first prefill: the first request may be what precompiles its program
    drafts = _Drafting(engine, acceptance) if engine.drafting else None
    pending = iter(requests)
    exhausted = False
    inflight = None  # the step dispatched last, not read yet: (its result, [(slot, request), ...])
    masks = MaskFiller(n, engine.cfg.vocab_size)
    put = engine.mask_placer()  # the masks' thread copies them to the device
    try:
        while True:
            free = [s for s in range(n) if slots.request[s] is None]
            if free and not exhausted:
                new = []
                for s in free:
                    r = next(pending, None)
                    if r is None:
                        exhausted = True
                        break
                    new.append((s, r))
                if new:
                    if inflight is not None:  # the host's view must be current before slots change hands
                        yield from _read(slots, inflight, cancelled, timer, drafts)
                        inflight = None
                    if cache is None:
                        if drafts is not None:
                            drafts.ready()
                        cache = engine.new_cache()
                    with timer:
                        if engine.run.batch_invariant:  # each request alone: its rows never share a prefill
                            events = []
                            for one in new:
                                cache, ev_one = _prefill(engine, cache, slots, [one], drafts, masks)
                                events += ev_one
                        else:
                            cache, events = _prefill(engine, cache, slots, new, drafts, masks)
                    for ev in events:
                        yield ev
                        _drop_if_cancelled(slots, ev, cancelled)
                    continue  # a prefilled request may already be done, and more slots may be free
            # The slots the next step runs: those whose request goes on after the step in flight, as far
            # as counts tell (a stop token is seen only when the step is read).
            ahead = {s for s, _ in inflight[1]} if inflight is not None else set()
            rows = [(s, r) for s, r in enumerate(slots.request)
                    if r is not None and not slots.ends_by_count(s, s in ahead)]
            if not rows:
                if inflight is not None:
                    yield from _read(slots, inflight, cancelled, timer, drafts)
                    inflight = None
                    continue
                if exhausted:
                    return
                continue
            active = np.zeros(n, bool)
            active[[s for s, _ in rows]] = True
            if any(r.matcher is not None and r.matcher.needs_mask for _, r in rows):
                if drafts is not None:
                    raise ValueError("constrained requests (a grammar) cannot run with speculative decoding")
                sampling = slots.sampling()
                last = inflight[0].token if inflight is not None else np.asarray(slots.last, np.int32)
                with timer:
                    cache, logits, positions = engine.decode_logits(cache, last, active)
                events = _take(slots, inflight, timer) if inflight is not None else []
                inflight = None
                pending_masks = masks.start(_mask_rows(slots, rows), put)
                yield from _hand_out(slots, events, cancelled)
                mask_bw = pending_masks.result()
                with timer:
                    step = engine.sample(logits, sampling, positions, mask_bw)
                inflight = (step, rows)
                continue
            with timer:
                if drafts is not None:
                    cache, step = drafts.step(cache, active, slots.sampling())
                else:
                    last = inflight[0].token if inflight is not None else np.asarray(slots.last, np.int32)
                    cache, step = engine.decode(cache, last, active, slots.sampling())
            if inflight is not None:
                yield from _read(slots, inflight, cancelled, timer, drafts)
            inflight = (step, rows)
    finally:  # the masks' thread ends with the run (or when its consumer drops it)
        masks.close()


def _mask_rows(slots: "_Slots", rows) -> list:
    """The (slot, matcher) rows whose masks a step takes: those whose request is still in its slot (all tokens
    are allowed elsewhere)."""
    return [(s, r.matcher) for s, r in rows if r.matcher is not None and slots.request[s] is r]


def _read(slots: "_Slots", inflight, cancelled: set[int], timer: "StepTimer",
          drafts: "_Drafting | None") -> Iterator[TokenEvent]:
    """Read a dispatched step's tokens and yield the events of the requests it ran that are still in their
    slots: one per slot for a decode step, each slot's emitted tokens in turn for a verification step."""
    if drafts is None:
        yield from _hand_out(slots, _take(slots, inflight, timer), cancelled)
        return
    step, rows = inflight
    with timer:
        host = jax.device_get(step)
    verdict = drafts.read(host)
    for s, r in rows:
        for j in range(int(verdict.count[s])):
            if slots.request[s] is not r:  # it ended (stop token, cancellation): the rest is dropped
                break
            if j == 0:
                drafts.count(verdict, s)
            ev = _emit(slots, s, verdict.rows, (s, j))
            yield ev
            _drop_if_cancelled(slots, ev, cancelled)


def _take(slots: "_Slots", inflight, timer: "StepTimer") -> list[TokenEvent]:
    """A dispatched decode step's tokens read and counted (matchers advanced) before any is handed out. A row
    whose request ended (stop token, cancellation) after its step was sent has no event."""
    step, rows = inflight
    with timer:
        host = jax.device_get(step)
    return [_emit(slots, s, host, s) for s, r in rows if slots.request[s] is r]


def _hand_out(slots: "_Slots", events: Iterable[TokenEvent], cancelled: set[int]) -> Iterator[TokenEvent]:
    for ev in events:
        yield ev
        _drop_if_cancelled(slots, ev, cancelled)


class _Drafting:
    """The scheduler's side of speculative decoding: the slots' drafting state on the device, the drafts'
    confidences as last read, and the acceptance counts."""

    def __init__(self, engine: Engine, acceptance: Acceptance | None):
        self.engine = engine
        self.acceptance = acceptance
        self.state = None  # made with the cache, at the first prefill
        self.confidence = np.zeros((engine.num_slots, engine.cfg.dspark_block_size), np.float32)
        self._width = None  # of the step dispatched last

    def ready(self) -> None:
        """Before the run's cache is made (and after whatever the first requests set off, a job's `precompile`):
        the widths' step times measured where no one did, on a cache of the engine's own."""
        if len(self.engine.widths) > 1 and self.engine.width_seconds is None:
            self.engine.measure_widths()

    def prefill(self, cache, slots: "_Slots", new: list[tuple[int, Request]], prompts, spliced, pad):
        """The prefill with the prompts' context keys written; the drafts are proposed once the first tokens
        are read (`start`)."""
        if self.state is None:
            self.state = self.engine.new_draft_state()
        cache, sampled, rings = self.engine.prefill(cache, prompts, [s for s, _ in new], slots.sampling(),
                                                    pad_slots=pad, spliced=spliced, rings=self.state.rings)
        self.state = dataclasses.replace(self.state, rings=rings)
        return cache, sampled

    def start(self, slots: "_Slots") -> None:
        """After a prefill's tokens are read (and no step is in flight): every slot's last token, position and
        budget from the host's counts, and the drafts after each proposed."""
        n = len(slots.request)
        budget, position = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for s, r in enumerate(slots.request):
            if r is not None:
                budget[s] = min(r.sampling.max_tokens - slots.generated[s], slots.max_len - slots.total[s])
                position[s] = slots.total[s] - 1
        self.state = self.engine.propose(self.state, np.asarray(slots.last, np.int32), budget, position,
                                         slots.sampling())
        if len(self.engine.widths) > 1:
            self.confidence = np.asarray(jax.device_get(self.state.drafts.confidence))

    def step(self, cache, active: np.ndarray, sampling: SamplingArrays):
        """Dispatch one verification step: (cache, what `_read` reads of it)."""
        width = self.engine.width_for(self.confidence, active)
        cache, self.state, verdict = self.engine.speculate(cache, self.state, active, sampling, width)
        if self.acceptance is not None:
            self.acceptance.step(width)
        confidence = self.state.drafts.confidence if len(self.engine.widths) > 1 else None
        return cache, (verdict, confidence)

    def read(self, host) -> speculative.Verdict:
        verdict, confidence = host
        if confidence is not None:
            self.confidence = np.asarray(confidence)
        return verdict

    def count(self, verdict: speculative.Verdict, s: int) -> None:
        if self.acceptance is not None:
            self.acceptance.add(verdict.rows.token.shape[1], int(verdict.count[s]), int(verdict.verified[s]))


class StepTimer:
    """Wall time spent inside the jitted steps (including the device-to-host copy of their results); with
    a `CompileClock`, less the time jax spent compiling them when they first ran."""

    def __init__(self, clock: CompileClock | None = None):
        self.seconds = 0.0
        self.steps = 0
        self._clock = clock

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._c0 = self._clock.seconds() if self._clock is not None else 0.0

    def __exit__(self, *exc):
        compiling = self._clock.seconds() - self._c0 if self._clock is not None else 0.0
        self.seconds += time.perf_counter() - self._t0 - compiling
        self.steps += 1


def _drop_if_cancelled(slots: _Slots, ev: TokenEvent, cancelled: set[int]) -> None:
    if ev.index in cancelled:
        cancelled.discard(ev.index)
        for s, r in enumerate(slots.request):
            if r is not None and r.index == ev.index:
                slots.request[s] = None


def _prefill(engine: Engine, cache, slots: _Slots, new: list[tuple[int, Request]], drafts: _Drafting | None,
             masks: MaskFiller):
    taken = {s for s, _ in new}
    size = engine.prefill_size(len(new))
    pad = [s for s in range(engine.num_slots) if s not in taken][:size - len(new)]
    for s, r in new:
        slots.request[s] = r
        slots.total[s] = len(r.prompt)
        slots.generated[s] = 0
    prompts, spliced = [r.prompt for _, r in new], [r.spliced for _, r in new]
    if drafts is not None:
        if any(r.matcher is not None for _, r in new):
            raise ValueError("constrained requests (a grammar) cannot run with speculative decoding")
        cache, sampled = drafts.prefill(cache, slots, new, prompts, spliced, pad)
    else:
        mask_bw = masks(_mask_rows(slots, new)) if any(r.matcher is not None and r.matcher.needs_mask for _, r in new) \
            else None
        cache, sampled = engine.prefill(cache, prompts, [s for s, _ in new], slots.sampling(), pad_slots=pad,
                                        spliced=spliced, masks=mask_bw)
    host = jax.device_get(sampled)
    events = [_emit(slots, s, host, s) for s, _ in new]
    if drafts is not None:
        drafts.start(slots)
    return cache, events


def _emit(slots: _Slots, s: int, host: Sampled, row) -> TokenEvent:
    """Slot s's token at `row` of `host` (an index into its arrays: the slot, or (slot, position) for a
    verification step's rows), counted, and the event it makes."""
    r = slots.request[s]
    token = int(host.token[row])
    if r.matcher is not None:
        r.matcher.consume(token)
    slots.generated[s] += 1
    slots.total[s] += 1
    slots.last[s] = token
    top = None
    if r.sampling.logprobs is not None:
        k = r.sampling.logprobs
        top = tuple((int(i), float(v)) for i, v in zip(host.top_ids[row][:k], host.top_logprobs[row][:k]))
    reason = None
    if token in r.stop_token_ids:
        reason = "stop"
    elif slots.generated[s] >= r.sampling.max_tokens or slots.total[s] >= slots.max_len:
        reason = "length"
    if reason:
        slots.request[s] = None
    return TokenEvent(r.index, token, float(host.logprob[row]), top, reason)

