"""mHC hyper-connections and the hyper-head against the reference; Sinkhorn's normalisation."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.sinkhorn.op import sinkhorn
from tests.helpers import CASES, assert_close


@pytest.mark.parametrize("case", list(CASES))
def test_hyper_connections_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in range(CASES[case]):
        layer = model.layer(i)
        for name in ("attn_hc", "ffn_hc"):
            post, comb, collapsed = getattr(layer, name)(jnp.asarray(cap[f"L{i}.{name}.in0"]))
            for got, k in ((post, 0), (comb, 1), (collapsed, 2)):
                assert_close(got, cap[f"L{i}.{name}.out{k}"], what=f"{case} L{i} {name} out{k}")


@pytest.mark.parametrize("case", list(CASES))
def test_hyper_head_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    assert_close(model.hc_head(jnp.asarray(cap["hc_head.in0"])), cap["hc_head.out0"], what="hc_head")


def test_sinkhorn_ends_column_normalised():
    rng = np.random.default_rng(0)
    comb = jnp.asarray(rng.random((3, 4, 4)) + 0.1)
    out = np.asarray(sinkhorn(comb, 20, 1e-6))
    np.testing.assert_allclose(out.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-3)
