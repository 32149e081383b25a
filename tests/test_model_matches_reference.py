"""Full-model parity with the Hugging Face reference, in fp32, for every naming and several lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import assert_close
from tests.reference.spec import CASES


@pytest.mark.parametrize("naming", ["hf", "hybrid", "original"])
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_logits_match_reference(reference, load_case, case, naming):
    model = load_case(case, naming)
    spec = next(c for c in CASES if c["name"] == case)
    for t in spec["seq_lens"]:
        ids = np.load(reference / case / f"input_ids_{t}.npy")
        ref = np.load(reference / case / f"logits_{t}.npy")
        ours = np.asarray(model(jnp.asarray(ids)))
        assert ours.dtype == np.float32
        assert_close(ours, ref, rtol=1e-4, what=f"{case}/{naming} T={t}")


def test_sequences_long_enough_to_exercise_compression(load_case):
    """The parity inputs must close HCA windows and make the indexer drop entries."""
    for spec in CASES:
        cfg = load_case(spec["name"]).cfg
        t = max(spec["seq_lens"])
        assert t // cfg.compress_rate_hca >= 2
        assert t // cfg.compress_rate_csa > cfg.index_topk


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_right_padded_batch_rows_equal_rows_alone(load_case, case):
    model = load_case(case)
    rng = np.random.default_rng(0)
    lengths = [37, 9, 24, 1]
    t = max(lengths)
    ids = rng.integers(0, model.cfg.vocab_size, (len(lengths), t))
    for i, n in enumerate(lengths):
        ids[i, n:] = rng.integers(0, model.cfg.vocab_size, t - n)  # junk padding, not a fixed id
    fwd = jax.jit(lambda x, n: model(x, n))
    batch = np.asarray(fwd(jnp.asarray(ids), jnp.asarray(lengths)))
    for i, n in enumerate(lengths):
        alone = np.asarray(model(jnp.asarray(ids[i:i + 1, :n])))[0]
        assert_close(batch[i, :n], alone, rtol=1e-5, what=f"row {i} (length {n})")
        assert np.all(batch[i, n:] == 0)
