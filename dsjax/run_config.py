"""`RunConfig`: how a model is run, apart from what it is (`ModelConfig`).

One frozen dataclass, validated once when made, used by the batch job, the engine, `plan`, `export` and
`bench`; the CLI's shared flags fill it (`dsjax.cli`). The choices are the tuples below, which the CLI
offers as they are.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp

from dsjax.parallel.mesh import parse_mesh
from dsjax.quant import KV_DTYPES

DTYPES = ("bfloat16", "float32")
# "keep": the checkpoint's (or preset's) storage stays on the device (FP8 blocks, FP4 experts),
# dequantized layer by layer inside each step; "bf16": dequantized once, at load, into `dtype`.
WEIGHTS = ("keep", "bf16")
# "auto": the Pallas kernels on GPUs and TPUs, the pure-JAX references elsewhere; "reference": the
# references everywhere; "interpret": the GPU kernels in Pallas's interpreter (tests on CPU).
KERNELS = ("auto", "reference", "interpret")
# How a causal encoder-decoder (DeepSeek-V4.1) prefills: "exact" runs its decoder layers only on the last
# positions whose windows reach the prompt's end (bit for bit as "full", which runs every layer on every
# token); "replay" is DeepInfer's approximate bounded replay (the last 140 positions, windows cut there).
DECODER_PREFILL = ("exact", "full", "replay")
# Speculative decoding: "dspark" drafts with the model's DSpark stages (DeepSeek-V4.1) and verifies the drafts in
# the target's step; the tokens are those the target alone gives (greedy) or distributed as its samples.
SPECULATIVE = ("off", "dspark")
RENAMED_WEIGHTS = {"fp8": "keep"}  # plan, bench and export's spelling until 0.2 (the CLI says so too)


# `--chunk-size auto` on an accelerator: the largest power-of-two chunk from 256 to 8,192 tokens with at
# most this many tokens in a prefill step of every slot. Measured on the H200 (docs/benchmarks.md): 8,192-
# token chunks for one long prompt (V4-Flash width, 1M tokens in 26.0 s; 2,048-token chunks were slower),
# 128 prompts × 512 in one 65,536-token step at 74% of the prefill roofline. CPUs keep 256.
AUTO_CHUNK_TOKENS = 65_536
AUTO_CHUNK_RANGE = (256, 8192)


def auto_chunk_size(slots: int, max_len: int, platform: str) -> int:
    """`--chunk-size auto`'s chunk for `slots` sequences of `max_len` tokens on `platform` (a JAX backend
    name): see `AUTO_CHUNK_TOKENS`; never more than max_len needs."""
    least, most = AUTO_CHUNK_RANGE
    if platform == "cpu":
        return least
    chunk = most
    while chunk > least and (slots * chunk > AUTO_CHUNK_TOKENS or chunk // 2 >= max_len):
        chunk //= 2
    return chunk


class RunConfigError(ValueError):
    """A run option out of range; the message names the option."""


def check_choice(name: str, value, choices: tuple, *, none: str | None = None) -> None:
    """Raise RunConfigError naming `name` unless `value` is one of `choices` (or None, where `none` says
    what None means). The one check of a run option's value, wherever a function takes it directly."""
    if value is None and none is not None:
        return
    if value not in choices:
        also = f" (or None: {none})" if none is not None else ""
        raise RunConfigError(f"{name} must be one of {choices}{also}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run options: `slots` sequences in flight, each of up to `max_len` tokens, prompts prefilled
    `chunk_size` tokens at a time; float weights and activations in `dtype`; the cache's K=V rows in
    `kv_dtype` (None: `dtype`); `weights`, `kernels`, `decoder_prefill` and `speculative` as the tuples above say;
    `drafts` the drafts a speculative step verifies per request (None: chosen each step from the drafter's
    confidence and the measured step times); `mesh` a spec such as "dp=2,ep=4" (None: one device);
    `batch_invariant` prefills each request alone, so that its logits do not depend on what else is in the batch."""

    slots: int = 8
    max_len: int = 4096
    chunk_size: int = 256
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    weights: str = "keep"
    kernels: str = "auto"
    mesh: str | None = None
    decoder_prefill: str = "exact"
    speculative: str = "off"
    drafts: int | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        if not isinstance(self.batch_invariant, bool):
            raise RunConfigError(f"batch_invariant must be true or false, got {self.batch_invariant!r}")
        for name, least in (("slots", 1), ("max_len", 2), ("chunk_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise RunConfigError(f"{name} must be an integer of at least {least}, got {value!r}")
        if self.weights in RENAMED_WEIGHTS:
            warnings.warn(f"weights={self.weights!r} is now spelled {RENAMED_WEIGHTS[self.weights]!r} "
                          f"(one vocabulary for every command); {self.weights!r} goes in 0.2",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "weights", RENAMED_WEIGHTS[self.weights])
        for name, choices in (("dtype", DTYPES), ("weights", WEIGHTS), ("kernels", KERNELS),
                              ("decoder_prefill", DECODER_PREFILL), ("speculative", SPECULATIVE)):
            check_choice(name, getattr(self, name), choices)
        if self.drafts is not None:
            if isinstance(self.drafts, bool) or not isinstance(self.drafts, int) or self.drafts < 0:
                raise RunConfigError(f"drafts must be an integer of at least 0 (or None: chosen each step), "
                                     f"got {self.drafts!r}")
            if self.speculative == "off":
                raise RunConfigError(f"drafts {self.drafts} needs speculative decoding: speculative 'dspark' "
                                     "(--speculative dspark)")
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES, none="dtype")
        if self.mesh is not None:
            if not isinstance(self.mesh, str):
                raise RunConfigError(f"mesh must be a spec such as 'dp=2,ep=4', got {self.mesh!r}")
            try:
                parse_mesh(self.mesh)
            except ValueError as e:
                raise RunConfigError(str(e)) from None

    def replace(self, **changes) -> RunConfig:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def jnp_dtype(self):
        """`dtype` as a jnp dtype."""
        return jnp.dtype(self.dtype)

    @property
    def quantized(self) -> bool:
        """Whether a quantized checkpoint or preset keeps its storage (`weights` "keep")."""
        return self.weights == "keep"
