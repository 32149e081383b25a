"""The speculative step's width from DSpark's confidences and each width's step time."""

from __future__ import annotations

import numpy as np
import pytest

from dsjax.engine.draft_schedule import choose_width, expected_tokens


def test_expected_tokens_are_one_plus_the_running_products():
    conf = np.asarray([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0], [0.9, 0.9, 0.9]])
    active = np.asarray([True, True, False])
    np.testing.assert_allclose(expected_tokens(conf, active),
                               [2.0, 2 + 0.5 + 1.0, 2 + 0.5 + 0.25 + 1.0, 2 + 0.5 + 0.25 + 0.25 + 1.0])


def test_the_width_follows_the_confidences_and_the_times():
    times = np.asarray([10.0, 11.0, 12.0, 13.0])  # ms at widths 1 … 4
    sure = np.full((4, 3), 0.95)
    unsure = np.full((4, 3), 0.05)
    active = np.ones(4, bool)
    assert choose_width(sure, active, times) == 4
    assert choose_width(unsure, active, times) == 1
    # Sure of the first draft only: one draft is worth its cost, the next ones are not.
    first = np.tile([0.9, 0.05, 0.05], (4, 1))
    assert choose_width(first, active, times) == 2
    # A width that costs twice as much never pays for drafts accepted half the time.
    assert choose_width(np.full((4, 3), 0.5), active, np.asarray([10.0, 20.0, 30.0, 40.0])) == 1
    assert choose_width(sure, active, np.asarray([10.0, np.inf, np.inf, np.inf])) == 1  # nothing else compiled


def test_bad_times_are_refused():
    with pytest.raises(ValueError, match="4 positive times"):
        choose_width(np.full((2, 3), 0.5), np.ones(2, bool), np.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match="positive"):
        choose_width(np.full((2, 3), 0.5), np.ones(2, bool), np.asarray([1.0, 0.0, 2.0, 3.0]))


def test_auto_compiles_a_plain_step_every_draft_and_one_between():
    from dsjax.engine.draft_schedule import auto_widths

    assert auto_widths(5) == (1, 3, 6) and auto_widths(1) == (1, 2) and auto_widths(0) == (1,)
    assert auto_widths(4) == (1, 3, 5)
