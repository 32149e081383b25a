"""`Engine`: one model's compiled steps over a cache of `RunConfig.slots` sequences, the programs built
ahead of a run (`precompile`), in parallel and on a background thread, and kept in a `ProgramStore`.

`decode` advances every active slot by one token; `prefill` fills the given slots from position 0,
one fixed-size chunk at a time, so a prompt of any length runs through the same compiled chunk step.
Both end in next-token logits for every slot, which the sampler program turns into `Sampled` rows
(`engine/steps.py` holds the step functions). With `RunConfig.speculative` "dspark", `speculate` takes
decode's place: each slot's token and DSpark's drafts verified in one target step of a chosen width, the cache
taken back past the rejected drafts and the next drafts proposed (`engine/speculative.py`). `Engine.precompile`
builds every program a job can need before its first request, in parallel, so none is compiled mid-job.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import Cache, init_cache
from dsjax.engine import encoder, speculative, steps
from dsjax.engine.compiles import BACKGROUND_THREAD
from dsjax.engine.draft_schedule import auto_widths, choose_width
from dsjax.engine.grammar import full_masks
from dsjax.engine.programs import ProgramStore, compile_for_store, describe
from dsjax.engine.sampling import SAMPLER_MODES, Sampled, SamplingArrays, SamplingModes, SamplingParams
from dsjax.engine.slots import prefill_buckets, prefill_rows
from dsjax.model import with_kernels
from dsjax.model_v41 import decoder_keep, replay_keep
from dsjax.run_config import RunConfig


class Engine:
    """Compiled steps for one model as `run` says: `run.slots` sequences of up to `run.max_len` tokens,
    prompts prefilled `run.chunk_size` tokens at a time, the cache's K=V rows in `run.kv_dtype` (None: the
    model's dtype, which the cache's other float arrays take; `dsjax.cache`). `run.dtype` and
    `run.weights` say how the model was built; the engine runs the model's kernel-backed operations as
    `run.kernels` says (`dsjax.model.with_kernels`, over the same weights); the mesh is
    the one in context (`jax.set_mesh`), on which the model's variables are placed. `params` are the
    model's weights (taken once; steps take them as an argument). `programs` keeps the programs
    `precompile` builds on disk, so that a later process loads them without tracing
    (`engine.programs`)."""

    def __init__(self, model, run: RunConfig, programs: ProgramStore | None = None):
        if not isinstance(run, RunConfig):
            raise TypeError(f"Engine takes a RunConfig (slots, max_len, chunk_size, kv_dtype, ...), got {run!r}")
        self.model = model = with_kernels(model, run.kernels)
        self.cfg = model.cfg
        self.run = run
        # `precompile`'s programs, by (name, variant), called directly: they skip jit's tracing. Those of
        # `programs` (a store on disk) are loaded from it when there, and stored when compiled.
        self.programs = programs
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self.fallbacks = 0  # calls whose inputs a precompiled program refused (then jit compiles its own)
        self._identity: tuple | None = None  # what `_program_key` hashes of the model and engine
        self.programs_loaded, self.load_seconds = 0, 0.0  # of `precompile`'s programs, from `programs`
        # Prefill buckets `precompile(later=…)` left to a background thread, until each is ready.
        self._later: set[int] = set()
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self.background: threading.Thread | None = None
        self.background_built = 0
        self.graphdef, self.params = nnx.split(model)
        self._static = steps.StaticGraph(self.graphdef)
        # The jitted steps with their statics bound, made once: `_call` falls back to them.
        self._decode_jit = functools.partial(steps.decode, self._static)
        self._propose_jit = functools.partial(steps.spec_propose, self._static)
        self._take_back_jit = functools.partial(steps.spec_take_back, self._static)
        self._prefill_jit = functools.partial(steps.prefill_chunk, self._static)
        self._encoder_jit = functools.partial(steps.prefill_encoder_chunk, self._static)
        # A causal encoder-decoder (V4.1) prefills its decoder on a prompt's last `_decoder_keep` positions.
        self._decoder_keep = None
        if getattr(self.cfg, "family", "v4") == "v4.1" and run.decoder_prefill != "full":
            self._decoder_keep = decoder_keep(self.cfg) if run.decoder_prefill == "exact" else replay_keep(self.cfg)
        self._new_cache_jit = functools.partial(steps.new_cache, *self._cache_statics())
        self._a_weight = jax.tree.leaves(self.params)[0]  # where the weights live (`_placed`)
        # Set by `precompile(images=True)`: every prefill chunk then runs the program that takes spliced
        # embeddings (with none for a chunk of text), so an image job compiles one program per row bucket.
        self.spliced_prefill = False
        self.encoder_chunks = 0  # prefill chunks that ran the encoder only (V4.1's exact truncation)
        self._no_splice: dict[int, tuple[jax.Array, jax.Array]] = {}  # rows → zero embeddings and mask
        # Speculative decoding (`run.speculative`): the widths (1 + drafts) a verification step may take, each a
        # program of its own, and a step's seconds at each (`measure_widths`) from which `width_for` chooses.
        self.drafting = run.speculative == "dspark"
        self.widths: tuple[int, ...] = ()
        if self.drafting:
            speculative.check_drafting(self.cfg, run.drafts)
            k = self.cfg.dspark_block_size
            self.widths = auto_widths(k) if run.drafts is None else (run.drafts + 1,)
        self._target_jits = {w: functools.partial(steps.spec_target, self._static, w) for w in self.widths}
        self.width_seconds: np.ndarray | None = None
        self.measure_seconds = 0.0  # of the last `measure_widths`, reading stored times included

    @property
    def num_slots(self) -> int:
        """Sequences the cache holds (`run.slots`)."""
        return self.run.slots

    @property
    def max_len(self) -> int:
        """Tokens each sequence may reach, prompt and generated (`run.max_len`)."""
        return self.run.max_len

    @property
    def chunk_size(self) -> int:
        """Tokens of a prompt per prefill chunk (`run.chunk_size`)."""
        return self.run.chunk_size

    @property
    def kv_dtype(self) -> str | None:
        """How the cache stores its K=V rows (`run.kv_dtype`; None: the model's dtype)."""
        return self.run.kv_dtype

    def _placed(self, spec: jax.sharding.PartitionSpec) -> jax.sharding.Sharding | None:
        """Where a step's other inputs live: on the context mesh by `spec`, or else as the weights do (on
        their device if they are committed to one; None: jax's default device, uncommitted). Every call of
        a step then sees its inputs placed alike and reuses one compiled program, `precompile`'s."""
        mesh = jax.sharding.get_mesh()
        if mesh.axis_names:
            return jax.sharding.NamedSharding(mesh, spec)
        weight = self._a_weight
        if not getattr(weight, "committed", False):
            return None
        if isinstance(weight.sharding, jax.sharding.NamedSharding):  # weights on a mesh, none in context
            return jax.sharding.NamedSharding(weight.sharding.mesh, jax.sharding.PartitionSpec())
        return weight.sharding if len(weight.sharding.device_set) == 1 else None

    def _put(self, *arrays):
        """Host inputs of a step, placed as `_placed` says. The scheduler passes the host's tokens to the
        first decode step after a prefill and the step in flight's (already placed) to the others: placed
        differently, the step would compile twice, the second time inside the decode loop."""
        return self._place(tuple(jnp.asarray(a) for a in arrays))

    def _place(self, tree):
        """A pytree of device arrays (sampling rows, step inputs), placed as `_placed` says."""
        placed = self._placed(jax.sharding.PartitionSpec())
        return tree if placed is None else jax.device_put(tree, placed)

    def _cache_statics(self) -> tuple:
        """`steps.new_cache`'s static arguments: the graph and the cache's sizes."""
        return self._static, self.num_slots, self.max_len, self.kv_dtype

    def new_cache(self) -> Cache:
        """An empty cache (one compiled program); under `jax.set_mesh` each device holds the slots the rules
        give it."""
        return self._call(("new_cache",), self._new_cache_jit, self.params)

    def _new_logits(self) -> jax.Array:
        return jnp.zeros((self.num_slots, self.cfg.vocab_size), jnp.float32,
                         device=self._placed(jax.sharding.PartitionSpec()))

    def _call(self, slot: tuple, jitted, *args):
        """`jitted(*args)`, through the precompiled program `slot` when there is one. A program refuses
        inputs of other shapes or placements before it runs (nothing donated yet): jit then compiles its
        own, which the job's summary counts as compiled during generation."""
        compiled = self._compiled.get(slot)
        if compiled is not None:
            try:
                return compiled(*args)
            except (TypeError, ValueError):
                self.fallbacks += 1
        return jitted(*args)

    def encode_image(self, pixels_hwc: np.ndarray) -> np.ndarray:
        """One image's embeddings `[image_tokens, hidden]` (float32, on the host) from its `[H, W, 3]`
        uint8 pixels (`pixels.decode_image`), for `Spliced` (`encode_images`)."""
        return self.encode_images([pixels_hwc])[0]

    def encode_images(self, images_hwc: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`encode_image` of several images at once: images are padded with blank cells to
        `pixels.cell_bucket` cells and those of one size are encoded together, so images of many sizes
        share a few compiled encoders (`encoder.encode_images`)."""
        return encoder.encode_images(self.model, self._static, self.params, list(images_hwc))

    @staticmethod
    def compilations() -> int:
        """Programs compiled so far by the steps of every engine in this process. Engines of the same
        model structure and shapes share them, so this stays constant once a job has warmed up."""
        return sum(f._cache_size() for f in (steps.decode, steps.prefill_chunk, steps.prefill_encoder_chunk,
                                             steps.sample_rows, encoder.encode_cells, steps.new_cache,
                                             steps.spec_target, steps.spec_verify, steps.spec_take_back,
                                             steps.spec_propose, steps.new_draft_state))

    def decode(self, cache: Cache, last_tokens: jax.Array, active: jax.Array,
               sampling: SamplingArrays) -> tuple[Cache, Sampled]:
        """Feed each active slot its last token and sample the next; inactive slots are untouched.
        `sampling` has one row per slot."""
        cache, logits_sv, positions_s = self.decode_logits(cache, last_tokens, active)
        return cache, self.sample(logits_sv, sampling, positions_s)

    def decode_logits(self, cache: Cache, last_tokens: jax.Array, active: jax.Array
                      ) -> tuple[Cache, jax.Array, jax.Array]:
        """`decode` without the sampler: the cache, every slot's next-token logits and the positions the next
        tokens take, for `sample` (a constrained batch samples once its masks are computed)."""
        return self._call(("decode",), self._decode_jit, self.params, cache,
                          *self._put(jnp.asarray(last_tokens, jnp.int32), jnp.asarray(active, bool)))

    def sample(self, logits_sv: jax.Array, sampling: SamplingArrays, positions_s: jax.Array,
               masks: np.ndarray | None = None) -> Sampled:
        """Every slot's next token from its logits; `masks` (`[slots, grammar.mask_words(vocab)]` int32, host or
        device) limits each row to its allowed tokens (the masked sampler programs, `precompile(masked=True)`)."""
        if masks is None:
            return self._call(("sample", sampling.modes), steps.sample_rows, logits_sv, self._place(sampling),
                              positions_s)
        if not isinstance(masks, jax.Array):
            masks = self.mask_placer()(masks)
        return self._call(("sample_masked", sampling.modes), steps.sample_rows, logits_sv, self._place(sampling),
                          positions_s, masks)

    def mask_placer(self) -> Callable[[np.ndarray], jax.Array]:
        """Puts a host array of token masks where `sample` takes them: placed as now (under this thread's mesh),
        callable from any thread (the masks' own, `MaskFiller.start`)."""
        placed = self._placed(jax.sharding.PartitionSpec())
        return lambda masks: jax.device_put(masks, placed)

    def lower_decode(self, cache: Cache, last_tokens: jax.Array, active: jax.Array) -> jax.stages.Lowered:
        """The decode step (without the sampler) lowered for these arguments (to compile with other
        options, or inspect); its compiled form takes `(self.params, cache, last_tokens, active)` and returns
        `(cache, logits [slots, vocab], positions [slots])`."""
        return steps.decode.lower(self._static, self.params, cache,
                                  *self._put(jnp.asarray(last_tokens, jnp.int32), jnp.asarray(active, bool)))

    def lower_prefill(self, cache: Cache, rows: int) -> jax.stages.Lowered:
        """The text-only prefill chunk of `rows` rows (without the sampler) lowered for this cache; its
        compiled form takes `(self.params, cache, logits [slots, vocab], tokens [rows, chunk_size], slots
        [rows], start [rows], n_valid [rows], ends [rows], None)` and returns `(cache, logits, positions)`."""
        return steps.prefill_chunk.lower(self._static, self.params, cache, self._new_logits(),
                                         *self._prefill_inputs(rows), None)

    def _prefill_inputs(self, rows: int) -> tuple:
        """Placed zeros as a prefill chunk of `rows` rows takes them: tokens, slots, start, n_valid, ends."""
        ids = np.zeros(rows, np.int32)
        return self._put(np.zeros((rows, self.chunk_size), np.int32), ids, ids, ids, np.zeros(rows, bool))

    def prefill(self, cache: Cache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                sampling: SamplingArrays, pad_slots: Sequence[int] = (),
                spliced: Sequence[Spliced | None] | None = None, rings: tuple | None = None,
                masks: np.ndarray | None = None):
        """Fill `slots` with `prompts` from position 0, chunk by chunk, and sample each prompt's next token:
        `(cache, sampled)`, and DSpark's context rings (`speculative.DraftState.rings`) with the prompts' keys
        written when `rings` are given (`drafting`).

        `sampling` has one row per cache slot, and so has the result: row `slots[i]` is prompt i's token
        (other rows mean nothing). `pad_slots` are extra distinct slots that ride along unchanged (to keep
        the row count, hence the compiled shape, within a few buckets). `spliced` (one entry per prompt, or
        None) gives embeddings that replace the token embeddings at some of a prompt's positions (images at
        their placeholders); a chunk without any runs the text-only program. `masks` limits each row's token to
        those its mask allows (as in `sample`).
        """
        rows = list(slots) + list(pad_slots)
        if len(set(rows)) != len(rows):
            raise ValueError(f"prefill slots must be distinct, got {rows}")
        n = len(rows)
        spliced = _check_spliced(spliced, prompts, self.cfg.hidden_size)
        lengths = np.zeros(n, np.int64)
        lengths[:len(prompts)] = [len(p) for p in prompts]
        current = np.asarray(cache.lengths)[rows]
        c = self.chunk_size
        n_chunks = max(1, -(-int(lengths.max()) // c))
        padded = np.zeros((n, n_chunks * c), np.int32)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        is_prompt = np.arange(n) < len(prompts)
        (slot_ids,) = self._put(np.asarray(rows, np.int32))
        logits_sv, positions_s = self._new_logits(), None
        for k in range(n_chunks):
            n_valid = n_valid_host = np.clip(lengths - k * c, 0, c)
            start = np.where(is_prompt, np.minimum(k * c, lengths), current)
            ends_here = is_prompt & (lengths > k * c) & (lengths <= (k + 1) * c)
            tokens, start, n_valid, ends_here = self._put(padded[:, k * c:(k + 1) * c], start.astype(np.int32),
                                                          n_valid.astype(np.int32), ends_here)
            chunk_spliced = _chunk_spliced(spliced, n, k * c, c)
            if chunk_spliced is not None:
                chunk_spliced = self._put(*chunk_spliced)
            elif self.spliced_prefill:
                chunk_spliced = self._no_splice_for(n)
            if self._decoder_keep is not None and self._encoder_only(k * c, n_valid_host, lengths):
                self.encoder_chunks += 1
                cache = self._call(("prefill_encoder", n, chunk_spliced is not None), self._encoder_jit,
                                   self.params, cache, tokens, slot_ids, start, n_valid, chunk_spliced)
                continue
            floor = None
            if self.run.decoder_prefill == "replay" and self._decoder_keep is not None:
                (floor,) = self._put(np.where(is_prompt, lengths - self._decoder_keep, 0).astype(np.int32))
            out = self._call(self._prefill_slot(n, chunk_spliced is not None, floor is not None, rings is not None),
                             self._prefill_jit, self.params, cache, logits_sv, tokens, slot_ids, start, n_valid,
                             ends_here, chunk_spliced, floor, rings)
            cache, logits_sv, positions_s = out[:3]
            rings = out[3] if rings is not None else None
        sampled = self.sample(logits_sv, sampling, positions_s, masks)
        return (cache, sampled) if rings is None else (cache, sampled, rings)

    @staticmethod
    def _prefill_slot(rows: int, spliced: bool, replay: bool, rings: bool) -> tuple:
        """The program table's name for a prefill chunk of `rows` rows with these inputs."""
        return ("prefill", rows, spliced) + (("replay",) if replay else ()) + (("rings",) if rings else ())

    def new_draft_state(self) -> speculative.DraftState:
        """The drafting state of empty slots (one compiled program)."""
        return self._call(("new_draft_state",), functools.partial(steps.new_draft_state, self._static, self.num_slots),
                          self.params)

    def propose(self, state: speculative.DraftState, tokens, budget, positions,
                sampling: SamplingArrays) -> speculative.DraftState:
        """`state` with each slot's last token `tokens`, its `budget` of tokens still to emit, and the drafts after
        the token at `positions` proposed (host arrays are placed as the steps' inputs)."""
        tokens, budget, positions = (x if isinstance(x, jax.Array) else self._put(x)[0]
                                     for x in (tokens, budget, positions))
        sampling = self._place(dataclasses.replace(sampling, modes=_draft_modes(sampling.modes)))
        return self._call(("spec_propose", sampling.modes), self._propose_jit, self.params, state.rings, tokens,
                          budget, positions, sampling)

    def speculate(self, cache: Cache, state: speculative.DraftState, active, sampling: SamplingArrays, width: int
                  ) -> tuple[Cache, speculative.DraftState, speculative.Verdict]:
        """One verification step of `width` positions per row (`speculative.rows_fed`): every active slot's token
        and drafts through the target, verified with `sampling`, the cache taken back past the rejected ones, and
        the next drafts proposed. Returns the cache, the drafting state and the step's `Verdict`."""
        if width not in self.widths:
            raise ValueError(f"width {width} is not one this engine verifies ({self.widths})")
        (active,) = self._put(np.asarray(active, bool)) if not isinstance(active, jax.Array) else (active,)
        cache, record, logits, start, n_valid = self._call(("spec_target", width), self._target_jits[width],
                                                          self.params, cache, state, active)
        placed = self._place(sampling)
        verdict = self._call(("spec_verify", width, sampling.modes), steps.spec_verify, logits, state, start, n_valid,
                             placed)
        cache, rings, positions = self._call(("spec_take_back", width), self._take_back_jit, self.params, cache, record,
                                             state, start, n_valid, verdict.count)
        state = dataclasses.replace(state, rings=rings)
        return cache, self.propose(state, verdict.token, verdict.budget, positions, sampling), verdict

    def width_for(self, confidence_bk: np.ndarray, active_b: np.ndarray) -> int:
        """The width of the next verification step: the fixed one (`run.drafts`), or the one with the most tokens
        per second expected from the drafts' confidences and the measured step times (`draft_schedule`)."""
        if len(self.widths) == 1:
            return self.widths[0]
        if self.width_seconds is None:
            raise RuntimeError("the widths' step times are not measured: call measure_widths() first")
        return choose_width(confidence_bk, active_b, self.width_seconds)

    def measure_widths(self, repeats: int = 3) -> np.ndarray:
        """Each width's verification step time in seconds (`width_seconds`, `[k + 1]`, inf for widths not
        compiled), timed on a cache of its own once the programs are built (every row live, as in a full batch), or
        read from the program store where this engine's were measured before (the same key as its programs, so any
        change measures again). The cache is freed before it returns.

        Prefill buckets still compiling in the background are waited for first: a compile beside the timed steps
        slows them unevenly, and the times are kept for every later run on the machine."""
        t0 = time.perf_counter()
        k = self.cfg.dspark_block_size
        key = None
        if self.programs is not None and jax.process_count() == 1:
            key = self.programs.key(self._model_identity(), "width_seconds/full", self.widths,
                                    repr(jax.sharding.get_mesh()), repeats)
            stored = self.programs.load_value(key)
            if stored is not None and len(stored) == k + 1:
                self.width_seconds = np.asarray(stored, np.float64)
                self.measure_seconds = time.perf_counter() - t0
                return self.width_seconds
        if self.background is not None:
            self.background.join()
        seconds = np.full(k + 1, np.inf)
        n = self.num_slots
        sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * n, [0] * n)
        # Every row live, from position 0 with drafts proposed, as in a full batch: idle rows feed the target
        # nothing, and a step's cost grows with the rows it feeds (the experts' grouped matmuls, the take-back).
        cache = self.new_cache()
        state = self.propose(self.new_draft_state(), np.zeros(n, np.int32), np.full(n, self.max_len - 1, np.int32),
                             np.zeros(n, np.int32), sampling)
        active = np.ones(n, bool)
        for w in self.widths:
            times = []
            for i in range(repeats + 1):  # the first call warms up
                t = time.perf_counter()
                cache, state, verdict = self.speculate(cache, state, active, sampling, w)
                jax.block_until_ready((cache, state, verdict))
                times.append(time.perf_counter() - t)
            seconds[w - 1] = float(np.median(times[1:]))
        del cache, state
        self.width_seconds, self.measure_seconds = seconds, time.perf_counter() - t0
        if key is not None:
            self.programs.save_value(key, [float(x) for x in seconds])
        return seconds

    def _encoder_only(self, first: int, n_valid: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether a chunk of positions `first …` lies wholly before every one of its prompts' last
        `_decoder_keep` positions (rows without tokens in it do not count)."""
        busy = n_valid > 0
        return bool(busy.any()) and bool(np.all(first + n_valid[busy] <= lengths[busy] - self._decoder_keep))

    def _no_splice_for(self, rows: int) -> tuple[jax.Array, jax.Array]:
        """Spliced-prefill inputs that splice nothing, kept on the device (made once per row bucket)."""
        if rows not in self._no_splice:
            self._no_splice[rows] = self._put(np.zeros((rows, self.chunk_size, self.cfg.hidden_size), np.float32),
                                              np.zeros((rows, self.chunk_size), bool))
        return self._no_splice[rows]

    def precompile(self, images: bool = False, modes: Sequence[SamplingModes] = SAMPLER_MODES,
                   buckets: Sequence[int] | None = None, threads: int | None = None,
                   later: Sequence[int] = (), masked: bool = False) -> int:
        """Build every program a run of this engine can need before it starts: the empty cache, the
        decode step, the prefill chunk for each row count of `buckets` (default: all, `prefill_buckets`),
        and the sampler for each of `modes` (with `masked`, also each with token masks, for constrained requests).
        With `images` the prefill programs are those that take
        spliced embeddings, and every later prefill runs them (`spliced_prefill`). Programs found in
        `self.programs` are loaded; the others are lowered one after another and compiled in `threads`
        threads (default: one per program, at most the CPU count), then stored there. Steps then call
        them directly. Returns the number of programs. (The image encoder compiles per image size bucket
        as images arrive: image sizes are not bounded ahead.)

        `later` names more prefill row buckets, built (or loaded) in a background thread once the others
        are ready, smallest first, while the engine runs: the set of programs is fixed here, and until a
        bucket is ready a prefill takes the smallest ready one that holds its rows (`prefill_size`).
        `close()` stops that thread after the program it is building. With speculative decoding over several
        widths, the widths' step times are measured (`measure_widths`) before that thread starts."""
        self.spliced_prefill = self.spliced_prefill or images
        shapes = jax.eval_shape(lambda: init_cache(self.model, self.num_slots, self.max_len, kv_dtype=self.kv_dtype))
        specs = steps.cache_specs(shapes) if jax.sharding.get_mesh().axis_names else jax.tree.map(
            lambda _: jax.sharding.PartitionSpec(), shapes)
        cache = jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._placed(p)),
                             shapes, specs)
        self._new_logits()  # a broadcast, run once: the program is tiny
        logits = jax.ShapeDtypeStruct((self.num_slots, self.cfg.vocab_size), jnp.float32,
                                      sharding=self._placed(jax.sharding.PartitionSpec()))
        positions = jax.ShapeDtypeStruct((self.num_slots,), jnp.int32, sharding=logits.sharding)
        n = self.num_slots
        # (slot, jitted function, its static arguments, the arguments its compiled form takes)
        todo = [(("new_cache",), steps.new_cache, self._cache_statics(), (self.params,))]
        state = None
        if self.drafting:
            state = self._abstract(jax.eval_shape(functools.partial(steps.new_draft_state, self._static, n), self.params))
            todo += [(("new_draft_state",), steps.new_draft_state, (self._static, n), (self.params,))]
            todo += self._speculative_programs(cache, state, modes)
        else:
            todo += [(("decode",), steps.decode, (self._static,),
                      (self.params, cache, *self._put(np.zeros(n, np.int32), np.zeros(n, bool))))]

        def prefill(rows):
            spliced = self._no_splice_for(rows) if self.spliced_prefill else None
            floor = None
            if self._decoder_keep is not None and self.run.decoder_prefill == "replay":
                floor = self._put(np.zeros(rows, np.int32))[0]
            rings = None if state is None else state.rings
            return (self._prefill_slot(rows, spliced is not None, floor is not None, rings is not None),
                    steps.prefill_chunk, (self._static,),
                    (self.params, cache, logits, *self._prefill_inputs(rows), spliced, floor, rings))

        def prefill_encoder(rows):
            spliced = self._no_splice_for(rows) if self.spliced_prefill else None
            tokens, slots, start, n_valid, _ = self._prefill_inputs(rows)
            return (("prefill_encoder", rows, spliced is not None), steps.prefill_encoder_chunk, (self._static,),
                    (self.params, cache, tokens, slots, start, n_valid, spliced))

        now = set(prefill_buckets(n) if buckets is None else buckets)
        todo += [prefill(rows) for rows in sorted(now, reverse=True)]
        if self._decoder_keep is not None:
            todo += [prefill_encoder(rows) for rows in sorted(now, reverse=True)]
        for m in modes:
            sampling = dataclasses.replace(self._place(SamplingArrays.of([SamplingParams()] * n, [0] * n)),
                                           modes=m)
            todo.append((("sample", m), steps.sample_rows, (), (logits, sampling, positions)))
            if masked:
                masks = self.mask_placer()(full_masks(n, self.cfg.vocab_size))
                todo.append((("sample_masked", m), steps.sample_rows, (), (logits, sampling, positions, masks)))
        build = [(slot, key, _lower(jitted, static, args)) for slot, key, jitted, static, args in self._unstored(todo)]
        if build:
            workers = threads or max(1, min(len(build), os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                built = list(pool.map(lambda item: compile_for_store(item[2]), build))  # XLA: outside the GIL
            for (slot, key, _), compiled in zip(build, built):
                self._keep(slot, key, *compiled)
        rest = sorted(set(later) - now)
        # A bucket counts as ready once its last program is built: the encoder-only one goes first.
        per_bucket = [[prefill_encoder(rows), prefill(rows)] if self._decoder_keep is not None else [prefill(rows)]
                      for rows in rest]
        missing = self._unstored(p for programs in per_bucket for p in programs)  # stored ones load now
        if self.drafting and len(self.widths) > 1 and self.width_seconds is None:
            # Timed now, with nothing compiling beside the steps: waiting for the background's prefill sizes
            # (measure_widths would) could hold the work back for minutes.
            self.measure_widths()
        if missing:
            with self._ready:
                self._later |= {slot[1] for slot, *_ in missing}
            self.background = threading.Thread(target=self._build_later, args=(missing, jax.sharding.get_mesh()),
                                               name=BACKGROUND_THREAD)
            self.background.start()
        return len(todo) + sum(len(programs) for programs in per_bucket)

    def _abstract(self, tree):
        """`jax.ShapeDtypeStruct`s of `tree`'s shapes, placed as the steps' host inputs are (`_placed`)."""
        placed = self._placed(jax.sharding.PartitionSpec())
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)

    def _speculative_programs(self, cache, state, modes: Sequence[SamplingModes]) -> list[tuple]:
        """`precompile`'s entries for speculative decoding: per width the target pass, the verification (per sampler
        mix of `modes`) and the take-back; the proposal per mix of the drafts' sampling."""
        n = self.num_slots
        (active,) = self._put(np.zeros(n, bool))
        todo = []
        sampling = {m: dataclasses.replace(self._place(SamplingArrays.of([SamplingParams()] * n, [0] * n)), modes=m)
                    for m in {*modes, *map(_draft_modes, modes)}}
        for w in self.widths:
            target = functools.partial(steps.spec_target, self._static, w)
            _, record, logits, start, n_valid = self._abstract(jax.eval_shape(target, self.params, cache, state,
                                                                              active))
            todo.append((("spec_target", w), steps.spec_target, (self._static, w), (self.params, cache, state, active)))
            verdict = self._abstract(jax.eval_shape(steps.spec_verify, logits, state, start, n_valid, sampling[modes[0]]))
            todo += [(("spec_verify", w, m), steps.spec_verify, (), (logits, state, start, n_valid, sampling[m]))
                     for m in modes]
            todo.append((("spec_take_back", w), steps.spec_take_back, (self._static,),
                         (self.params, cache, record, state, start, n_valid, verdict.count)))
        for m in sorted(set(map(_draft_modes, modes)), key=repr):
            todo.append((("spec_propose", m), steps.spec_propose, (self._static,),
                         (self.params, state.rings, state.token, state.budget, state.budget, sampling[m])))
        return todo

    def _unstored(self, todo) -> list[tuple]:
        """Of `todo`'s (slot, jitted, static, args), load those `self.programs` holds into the steps' table;
        the others as (slot, key, jitted, static, args), key None without a store."""
        missing = []
        for slot, jitted, static, args in todo:
            key = self._program_key(slot, args) if self.programs is not None else None
            t = time.perf_counter()
            compiled = self.programs.load(key) if key is not None else None
            if compiled is None:
                missing.append((slot, key, jitted, static, args))
                continue
            self._compiled[slot] = compiled
            self.programs_loaded += 1
            self.load_seconds += time.perf_counter() - t
        return missing

    def _keep(self, slot: tuple, key: str | None, compiled: jax.stages.Compiled, fresh: bool) -> None:
        """A program just built: into the steps' table, and into the store if XLA compiled it here."""
        if key is not None and fresh:
            self.programs.save(key, compiled)
        self._compiled[slot] = compiled

    def _build_later(self, todo: list, mesh) -> None:
        """`precompile`'s background thread: each later prefill bucket lowered, compiled and stored in
        turn, and handed to the steps as it is ready."""
        # Tracing and lowering hold the GIL: the engine's own thread, which needs it for a moment per step,
        # gets it back within a tenth of a millisecond rather than Python's default 5 ms.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 1e-4))
        try:
            with jax.set_mesh(mesh) if mesh.axis_names else contextlib.nullcontext():  # the mesh is per thread
                for slot, key, jitted, static, args in todo:
                    if self._stop.is_set():
                        break
                    lowered = _lower(jitted, static, args)
                    if self._stop.is_set():  # stopped while lowering: no compile for the process to wait for
                        break
                    self._keep(slot, key, *compile_for_store(lowered))  # storing it outside the lock
                    if slot[0] == "prefill_encoder":  # its bucket's prefill program comes next
                        continue
                    with self._ready:
                        self._later.discard(slot[1])
                        self.background_built += 1
                        self._ready.notify_all()
        finally:
            sys.setswitchinterval(interval)
            with self._ready:  # whatever is left will not come: a prefill must not wait for it
                self._later.clear()
                self._ready.notify_all()

    def prefill_size(self, n: int) -> int:
        """The rows a prefill of `n` new requests runs: `prefill_rows(n)`, or the smallest larger bucket
        that is ready while that one is still being built in the background (it waits only when no ready
        bucket holds `n` rows)."""
        want = prefill_rows(n, self.num_slots)
        with self._ready:
            while True:
                ready = [slot[1] for slot in list(self._compiled)
                         if slot[0] == "prefill" and slot[2] == self.spliced_prefill and slot[1] >= want]
                if want in ready:
                    return want
                if ready:
                    return min(ready)
                if not self._later:  # none was precompiled: jit compiles it
                    return want
                self._ready.wait()

    def pending_buckets(self) -> list[int]:
        """The prefill buckets still being built in the background."""
        with self._ready:
            return sorted(self._later)

    def close(self) -> None:
        """Stop building later buckets after the one in progress (which is still stored)."""
        self._stop.set()

    def _program_key(self, slot: tuple, args: tuple) -> str | None:
        """The store's key for program `slot` of this engine called with `args`: the model's structure and
        the engine's shapes (not for the sampler, which holds neither), the mesh in context and the inputs
        (`programs.describe`). None on several processes, where programs are not stored (each process
        compiles for its own devices)."""
        if jax.process_count() > 1:
            return None
        mesh = jax.sharding.get_mesh()
        if slot[0] == "sample":  # the sampler holds nothing of the model or the cache: engines share it
            return self.programs.key(slot, repr(mesh), describe(args))
        return self.programs.key(self._model_identity(), slot, repr(mesh), describe(args))

    def _model_identity(self) -> tuple:
        """What the store's keys hold of the model and the engine's shapes."""
        if self._identity is None:
            graph = hashlib.sha256(repr(self.graphdef).encode()).hexdigest()
            self._identity = (graph, repr(self.cfg), self.num_slots, self.max_len, self.chunk_size, self.kv_dtype)
        return self._identity


def _draft_modes(modes: SamplingModes) -> SamplingModes:
    """The sampler mix the drafts are drawn with: the requests' own, without the alternatives (no draft reports)."""
    return dataclasses.replace(modes, logprobs=False)


def _lower(jitted, static: tuple, args: tuple) -> jax.stages.Lowered:
    """`jitted` lowered for its static arguments and `args` (every step takes its statics first)."""
    return jitted.lower(*static, *args)


@dataclasses.dataclass(frozen=True)
class Spliced:
    """Embeddings `[P, hidden]` that replace a prompt's token embeddings at `positions` `[P]`."""

    positions: np.ndarray
    embeds: np.ndarray


def _check_spliced(spliced, prompts, hidden: int) -> list[Spliced | None] | None:
    if spliced is None or all(s is None for s in spliced):
        return None
    if len(spliced) != len(prompts):
        raise ValueError(f"spliced has {len(spliced)} entries for {len(prompts)} prompts")
    for i, (s, p) in enumerate(zip(spliced, prompts)):
        if s is None:
            continue
        pos = np.asarray(s.positions)
        if pos.ndim != 1 or s.embeds.shape != (len(pos), hidden):
            raise ValueError(f"prompt {i}: spliced embeddings {s.embeds.shape} must be [{len(pos)}, {hidden}] "
                             f"for its {len(pos)} positions")
        if len(pos) and (pos.min() < 0 or pos.max() >= len(p) or len(np.unique(pos)) != len(pos)):
            raise ValueError(f"prompt {i}: spliced positions must be distinct and within its {len(p)} tokens")
    return list(spliced)


def _chunk_spliced(spliced, n: int, first: int, c: int):
    """(embeds `[n, c, hidden]`, mask `[n, c]`) for the chunk at `first`, or None if nothing lands in it."""
    if spliced is None:
        return None
    hits = []
    for i, s in enumerate(spliced):
        if s is not None:
            pos = np.asarray(s.positions)
            at = (pos >= first) & (pos < first + c)
            if at.any():
                hits.append((i, pos[at] - first, s.embeds[at]))
    if not hits:
        return None
    embeds = np.zeros((n, c, hits[0][2].shape[-1]), np.float32)
    mask = np.zeros((n, c), bool)
    for i, cols, rows in hits:
        embeds[i, cols], mask[i, cols] = rows, True
    return embeds, mask


