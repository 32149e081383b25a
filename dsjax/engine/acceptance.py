"""What speculative decoding's verification kept: the figures a job's summary reports, counted on the host from each
step's `speculative.Verdict`."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Acceptance:
    """Counts over the verification steps of a run, for drafts of up to `max_drafts` tokens a step."""

    max_drafts: int
    steps: int = 0  # target steps (verification steps)
    rows: int = 0  # request rows those steps ran
    tokens: int = 0  # tokens those rows emitted: their kept drafts and the target's token after them
    verified: np.ndarray = None  # [max_drafts]: rows that verified draft i
    accepted: np.ndarray = None  # [max_drafts]: rows that kept it
    widths: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # steps per width

    def __post_init__(self):
        self.verified = np.zeros(self.max_drafts, np.int64) if self.verified is None else self.verified
        self.accepted = np.zeros(self.max_drafts, np.int64) if self.accepted is None else self.accepted

    def add(self, width: int, count: int, verified: int) -> None:
        """One row of a step of `width`: it emitted `count` tokens (1 + the drafts kept) of `verified` drafts."""
        if not 1 <= count <= verified + 1 or verified > self.max_drafts:
            raise ValueError(f"a row cannot emit {count} tokens from {verified} drafts (at most {self.max_drafts})")
        self.rows += 1
        self.tokens += count
        self.verified[:verified] += 1
        self.accepted[:count - 1] += 1

    def step(self, width: int) -> None:
        """One verification step of `width` positions per row."""
        self.steps += 1
        self.widths[width] += 1

    def summary(self) -> dict:
        """`mean_accepted_length`: tokens a request gets per target step (its kept drafts and the target's token);
        `acceptance_by_position[i]`: the share of the rows that verified draft i that kept it (a draft is kept only
        after every draft before it); `tokens_per_target_step`: tokens all rows got per step; `steps_by_width`."""
        rate = [round(float(a / v), 4) if v else None for a, v in zip(self.accepted, self.verified)]
        return {"target_steps": self.steps,
                "mean_accepted_length": round(self.tokens / self.rows, 4) if self.rows else None,
                "acceptance_by_position": rate,
                "tokens_per_target_step": round(self.tokens / self.steps, 4) if self.steps else None,
                "steps_by_width": {str(w): n for w, n in sorted(self.widths.items())}}
