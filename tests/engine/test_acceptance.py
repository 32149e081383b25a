"""The acceptance figures of speculative decoding (dsjax.engine.acceptance), counted by hand."""

import pytest

from dsjax.engine.acceptance import Acceptance


def test_the_figures_of_a_few_rows():
    a = Acceptance(3)
    a.step(4)
    a.add(4, count=4, verified=3)  # every draft kept, then the target's token
    a.add(4, count=1, verified=3)  # the first draft rejected
    a.step(2)
    a.add(2, count=2, verified=1)
    s = a.summary()
    assert s["target_steps"] == 2 and s["steps_by_width"] == {"2": 1, "4": 1}
    assert s["mean_accepted_length"] == round(7 / 3, 4) and s["tokens_per_target_step"] == 3.5
    assert s["acceptance_by_position"] == [round(2 / 3, 4), 0.5, 0.5]


def test_nothing_counted_gives_no_figures_and_impossible_rows_are_refused():
    a = Acceptance(2)
    s = a.summary()
    assert s["mean_accepted_length"] is None and s["acceptance_by_position"] == [None, None]
    with pytest.raises(ValueError, match="cannot emit 3 tokens from 1 drafts"):
        a.add(2, count=3, verified=1)
    with pytest.raises(ValueError, match="at most 2"):
        a.add(4, count=1, verified=3)
