"""How many drafts a speculative step verifies: the width with the most expected tokens per second.

A verification step runs the target over every slot's row of w = 1 + n positions (the emitted token and n drafts),
one compiled program per width, so its time depends on the width and not on which rows use it. DSpark's confidence
c_i estimates that draft i is accepted given that the drafts before it were; the chance that drafts 0 … i all are is
the running product a_i = c_0 ⋯ c_i, which never grows along a row, so a draft is worth verifying only after every
draft before it. A row verifying n drafts emits 1 + a_0 + … + a_{n−1} tokens in expectation, and the step takes the
width's measured time t(w). DeepInfer packs rows of different lengths under a total query budget (its variable-length
MTP scheduler); with fixed shapes the budget is the width, and every row verifies w − 1 drafts.
"""

from __future__ import annotations

import numpy as np


def auto_widths(max_drafts: int) -> tuple[int, ...]:
    """The widths `--drafts auto` compiles and chooses among: a plain step, every draft, and one between. Each
    width is a target pass and a take-back of its own (the largest programs a job compiles), so every width of the
    block would double a first run's start-up; the expected tokens of the widths left out lie between those of
    their neighbours."""
    return tuple(sorted({1, (max_drafts + 2) // 2, max_drafts + 1}))


def expected_tokens(confidence_bk: np.ndarray, active_b: np.ndarray) -> np.ndarray:
    """`[k + 1]`: the tokens the active rows emit in expectation at each width w = 1 … k + 1."""
    a_bk = np.cumprod(np.clip(np.asarray(confidence_bk, np.float64), 0.0, 1.0), axis=1)
    per_row = np.concatenate([np.ones((a_bk.shape[0], 1)), 1.0 + np.cumsum(a_bk, axis=1)], axis=1)
    return per_row[np.asarray(active_b, bool)].sum(axis=0)


def choose_width(confidence_bk: np.ndarray, active_b: np.ndarray, step_seconds: np.ndarray) -> int:
    """The width (1 … k + 1) whose expected tokens per second are highest; `step_seconds[w − 1]` is a step's time
    at width w (`np.inf` for a width not compiled). Ties go to the narrower width."""
    step_seconds = np.asarray(step_seconds, np.float64)
    k = np.asarray(confidence_bk).shape[1]
    if step_seconds.shape != (k + 1,) or not (step_seconds > 0).all():
        raise ValueError(f"step_seconds must hold {k + 1} positive times (widths 1 … {k + 1}), got {step_seconds}")
    rate = expected_tokens(confidence_bk, active_b) / step_seconds
    return int(np.argmax(rate)) + 1
