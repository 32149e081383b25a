"""`generate`: token-id prompts in, one result per prompt out (in prompt order)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dsjax.engine import scheduler
from dsjax.engine.engine import Engine
from dsjax.engine.grammar import Matcher
from dsjax.engine.sampling import SamplingParams
from dsjax.engine.scheduler import Request
from dsjax.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely alternatives


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token, included in tokens) or "length"
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int


def request_seed(job_seed: int, index: int) -> int:
    """The seed of a request that did not set one: fixed by the job's seed and the prompt's index."""
    return int(np.random.SeedSequence([job_seed, index]).generate_state(1)[0])


def make_requests(cfg, prompts: Sequence[Sequence[int]], sampling, max_len: int, seed: int,
                  matchers: Sequence[Matcher | None] | None = None) -> list[Request]:
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    matchers = [None] * len(prompts) if matchers is None else list(matchers)
    if len(matchers) != len(prompts):
        raise ValueError(f"got {len(matchers)} matchers for {len(prompts)} prompts")
    requests = []
    for i, (prompt, sp, matcher) in enumerate(zip(prompts, sampling, matchers)):
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if not all(0 <= t < cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size})")
        if len(prompt) >= max_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_len {max_len} leaves no room to generate")
        stop = cfg.eos_token_id if sp.stop_token_ids is None else sp.stop_token_ids
        requests.append(Request(i, prompt, sp, request_seed(seed, i) if sp.seed is None else sp.seed,
                                frozenset(int(t) for t in stop), matcher=matcher))
    return requests


def generate(model, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = None,
             *, run: RunConfig | None = None, seed: int = 0, engine: Engine | None = None,
             matchers: Sequence[Matcher | None] | None = None) -> list[GenerationResult]:
    """Generate for each token-id prompt with continuous batching over `run.slots` slots of `run.max_len`
    tokens (prompt + generated) each, prompts prefilled `run.chunk_size` tokens at a time. The default
    `run`: 8 slots, chunks of 64 tokens, and room for the longest prompt plus the largest max_tokens. Pass
    an `engine` instead to reuse its compiled steps across calls. `matchers` (one per prompt, or None) constrain
    prompts' outputs to grammars (`grammar.Grammars.matcher`).
    """
    sampling = SamplingParams() if sampling is None else sampling
    if engine is None:
        if run is None:
            sps = [sampling] if isinstance(sampling, SamplingParams) else list(sampling)
            max_len = max((len(p) for p in prompts), default=1) + max((s.max_tokens for s in sps), default=1)
            run = RunConfig(slots=8, max_len=max_len, chunk_size=64)
        engine = Engine(model, run)
    elif run is not None:
        raise ValueError("give generate a run or an engine (which has its own), not both")
    requests = make_requests(engine.cfg, prompts, sampling, engine.max_len, seed, matchers)
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[TokenLogprob]] = [[] for _ in requests]
    finish: list[str | None] = [None] * len(requests)
    for ev in scheduler.run(engine, requests):
        tokens[ev.index].append(ev.token)
        if ev.top is not None:
            logprobs[ev.index].append(TokenLogprob(ev.token, ev.logprob, ev.top))
        if ev.finish_reason:
            finish[ev.index] = ev.finish_reason
    return [GenerationResult(tokens[i], finish[i], logprobs[i] if r.sampling.logprobs is not None else None,
                             len(r.prompt)) for i, r in enumerate(requests)]
