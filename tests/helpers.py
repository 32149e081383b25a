"""Shared test helpers."""

from tests.conftest import assert_close  # noqa: F401

CASES = {"mixed": 6, "legacy": 5}  # case name → number of layers


def layers_of(cfg, attention_type=None, mlp_type=None):
    return [i for i, (a, m) in enumerate(cfg.layer_kinds)
            if (attention_type is None or a == attention_type) and (mlp_type is None or m == mlp_type)]
