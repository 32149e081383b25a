"""A limit on a response's thinking part: once it has taken its budget of tokens, the end-of-thinking token is the
only one allowed, so the answer still gets the rest of `max_tokens` (an output format after the thinking part
then always has room to start). It works as a request's matcher (`scheduler.Request.matcher`), around the
request's grammar matcher where it has one.
"""

from __future__ import annotations

import numpy as np

from dsjax.engine.grammar import Matcher, fill_masks, only


class ThinkingBudget:
    """Ends a thinking part after `budget` tokens by allowing only `end` (the end-of-thinking token) from then until
    it comes; `inner` (the request's grammar, or None) is advanced and asked for its mask as it would be alone."""

    def __init__(self, end: int, budget: int, inner: Matcher | None = None):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"a thinking budget is a number of tokens >= 0, got {budget!r}")
        self.end, self.left, self.inner = int(end), budget, inner
        self.thinking = True
        self.forced = False  # whether the budget ended the thinking part

    @property
    def error(self) -> str | None:
        return self.inner.error if self.inner is not None else None

    @property
    def accepting(self) -> bool:
        return self.inner.accepting if self.inner is not None else True

    @property
    def needs_mask(self) -> bool:
        """Whether the step after the one in flight may need a mask: the inner grammar's, or the forced end (its
        token unread, the step in flight may spend the last of the budget). Otherwise the request decodes on the
        unmasked path."""
        return self.inner is not None or (self.thinking and self.left <= 1)

    def consume(self, token: int) -> None:
        """Advance past `token`."""
        if self.thinking:
            if int(token) == self.end:
                self.thinking = False
                self.forced = self.left <= 0
            else:
                self.left -= 1
        if self.inner is not None:
            self.inner.consume(token)

    def fill(self, mask_bw: np.ndarray, row: int) -> None:
        """Row `row` of `mask_bw`: only `end` once the budget is spent, else the inner grammar's mask (or, without
        one, the row as it is: every token)."""
        fill_masks(mask_bw, [(row, self)])

    def mask_source(self, mask_bw: np.ndarray, row: int) -> Matcher | None:
        """`Matcher.mask_source`: the inner grammar where it decides the row, else None (the row filled here, or
        left free)."""
        if self.thinking and self.left <= 0:
            only(mask_bw, row, [self.end])
            return None
        return self.inner.mask_source(mask_bw, row) if self.inner is not None else None
