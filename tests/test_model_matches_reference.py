"""Full-model parity with the Hugging Face reference, in fp32, for every naming and several lengths."""

import jax
from flax import nnx
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


@pytest.mark.parametrize("leaf, trivial", [
    ("self_attn.sinks", 0.0),
    ("compressor.position_bias", 0.0),
    ("indexer.position_bias", 0.0),
    ("attn_hc.base", 0.0),
    ("ffn_hc.scale", 1.0),
    ("mlp.gate.e_score_correction_bias", 0.0),
    ("mlp.gate.tid2eid", 0),
    ("hc_head.hc_base", 0.0),
])
def test_parity_would_catch_a_feature_left_out(reference, load_case, leaf, trivial):
    """Setting one feature to its trivial value must move the logits far beyond the parity tolerance,
    so the parity tests cannot pass with that feature ignored."""
    model = nnx.clone(load_case("mixed"))
    hit = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        if ".".join(str(p) for p in path).endswith(leaf):
            var.set_value(jnp.full_like(var.get_value(), trivial))
            hit += 1
    assert hit
    ids = np.load(reference / "mixed" / "input_ids_64.npy")
    ref = np.load(reference / "mixed" / "logits_64.npy")
    err = np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max()
    assert err > 1e-2 * np.abs(ref).max(), f"{leaf}: logits moved only {err:.3g}"
