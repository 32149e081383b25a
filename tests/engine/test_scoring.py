"""Teacher-forced scoring through prefill + cached decode equals the no-cache forward."""

import numpy as np
import pytest

from dsjax.config import ModelConfig
from dsjax.engine.scoring import teacher_forced_logprobs
from dsjax.training.loss import evaluate
from dsjax.training.train import init_model


def test_cached_scoring_equals_the_full_forward_for_any_prefill_split():
    model = init_model(ModelConfig.preset("tiny"), seed=2)
    rows = np.random.default_rng(3).integers(0, 512, (3, 45))
    full = evaluate(model, rows)
    for prefill in (1, 13, 45):  # all decode; a partial chunk; all prefill
        lp = teacher_forced_logprobs(model, rows, prefill, chunk_size=8)
        assert lp.shape == (3, 44)
        assert abs(-lp.astype(np.float64).mean() - full) < 1e-5


def test_bad_prefill_length_is_refused():
    model = init_model(ModelConfig.preset("tiny"), seed=2)
    with pytest.raises(ValueError, match="prefill_tokens"):
        teacher_forced_logprobs(model, np.zeros((1, 5), np.int32), 0)
