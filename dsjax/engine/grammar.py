"""Constrained decoding: the grammar a request's output must follow (a JSON schema, a regex, an EBNF or Lark
grammar), compiled by llguidance against the model's tokenizer, and the per-request matchers whose token
masks the sampler applies on the device (`sampling.sample`'s `mask_bw`).

A mask is a row of `mask_words(vocab)` int32 words, bit `t % 32` of word `t // 32` set where token t is
allowed. A grammar that starts after a trigger token (`Constraint.after`: the end of the thinking part, or the
token that opens a tool call) leaves every token but the stop tokens free until the trigger, then holds the rest
to the grammar; the stop tokens are allowed only where the grammar is complete (or, for an `optional` grammar,
also before the trigger), so a constrained output always parses.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

KINDS = ("json_schema", "regex", "ebnf", "lark")
JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (an invalid schema, regex or grammar), with its message."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's output must match: a `kind` of `KINDS` and its `text` (a JSON schema as JSON text, a
    regular expression, a GBNF-style EBNF grammar with a `root` rule, a Lark grammar with a `start` rule);
    `after`, a token id the constraint starts after (None: from the first token); `optional`: an output that
    never emits `after` is complete too (an optional tool call)."""

    kind: str
    text: str
    after: int | None = None
    optional: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a constraint's kind must be one of {KINDS}, got {self.kind!r}")
        if self.optional and self.after is None:
            raise ValueError("an optional constraint needs the token it starts after")

    def grammar(self, stop_ids: Sequence[int]) -> str:
        """The llguidance grammar (its JSON form); `stop_ids` are kept out of the free part before `after`."""
        body: dict = {"name": "body"}
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if isinstance(schema, dict) and "x-guidance" not in schema:
                # One way to space JSON (as Python's json.dumps does): free whitespace lets a model pad an
                # answer with blanks until it runs out of tokens.
                schema = {**schema, "x-guidance": JSON_SPACING}
            body["json_schema"] = schema
        elif self.kind == "regex":
            body["lark_grammar"] = "start: /" + llguidance.regex_to_lark(self.text) + "/"
        elif self.kind == "ebnf":
            try:
                body["lark_grammar"] = llguidance.gbnf_to_lark.any_to_lark(self.text)
            except Exception as e:  # the converter raises whatever its parser meets
                raise GrammarError(f"the EBNF grammar could not be read: {e}") from None
        else:
            body["lark_grammar"] = self.text
        if self.after is None:
            body.pop("name")
            return json.dumps({"grammars": [body]})
        free = ",".join(str(t) for t in sorted({*stop_ids, self.after}))
        rest = f"(<[{self.after}]> @body)?" if self.optional else f"<[{self.after}]> @body"
        top = {"lark_grammar": f"start: <[^{free}]>* {rest}"}
        return json.dumps({"grammars": [top, body]})


class Grammars:
    """Compiles constraints against one tokenizer, each distinct grammar once: the `capacity` most recently used
    are kept (a job's requests mostly share a few schemas; the bound keeps a job of many distinct schemas from
    growing without end). Safe to use from several threads.

    `tokenizer_json` is the text of the model's `tokenizer.json`; `vocab_size` the model's (rows of logits:
    ids past the tokenizer's are never allowed inside a grammar); `stop_ids` the tokens that end a response."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: Sequence[int], capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"the grammar cache needs a capacity >= 1, got {capacity}")
        self.stop_ids = tuple(sorted(set(int(t) for t in stop_ids)))
        if not self.stop_ids:
            raise ValueError("constrained decoding needs the model's stop tokens (none given)")
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.stop_ids))
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (misses of the cache)

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A fresh matcher of `constraint`'s grammar; raises `GrammarError` naming what is wrong with it."""
        return Matcher(self._template(constraint).deep_copy(), self.stop_ids)

    def check(self, constraint: Constraint) -> None:
        """Compile `constraint`'s grammar (into the cache) or raise `GrammarError` naming what is wrong with it."""
        self._template(constraint)

    def _template(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = constraint.grammar(self.stop_ids)
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is None:
            template = self._compile(grammar)
            with self._lock:
                self._compiled[grammar] = template
                self._compiled.move_to_end(grammar)
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return template

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError("; ".join(m.strip() for m in messages) or "llguidance refused the grammar")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.compiles += 1
        return matcher


class Matcher:
    """One request's place in its grammar: `consume` each token it emits, `fill` its mask for the next."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: tuple[int, ...]):
        self._m = matcher
        self._stop_ids = stop_ids
        self.error: str | None = None  # set when llguidance failed mid-way (the response is then cut)

    def consume(self, token: int) -> None:
        """Advance past `token` (one the mask allowed)."""
        if self.error is None and not self._m.is_stopped() and not self._m.consume_token(int(token)):
            self.error = self._m.get_error() or f"the grammar refused token {token}"

    def fill(self, mask_bw: np.ndarray, row: int) -> None:
        """Row `row` of `mask_bw` (int32, `[B, mask_words(vocab)]`): the tokens allowed next. After a failure only
        the stop tokens are, so the response ends (its `error` says why)."""
        fill_masks(mask_bw, [(row, self)])

    def mask_source(self, mask_bw: np.ndarray, row: int) -> "Matcher | None":
        """The grammar matcher whose mask row `row` takes (`fill_masks` computes it), or None where this row is
        already filled (after a failure: the stop tokens only)."""
        if self.error is None:
            return self
        only(mask_bw, row, self._stop_ids)
        return None

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete match."""
        return self._m.is_accepting()

    @property
    def needs_mask(self) -> bool:
        """Whether the step after the one in flight may need this request's mask (a grammar's: always)."""
        return True


class MaskFiller:
    """A batch's token masks, `[rows, mask_words(vocab)]`: every token allowed, but in the rows of the matchers
    given. Their grammars' rows are computed together on llguidance's threads (started at the first batch),
    and `start` computes them off the caller's thread, so the caller can go on while they are made."""

    def __init__(self, rows: int, vocab: int):
        self.rows, self.vocab = rows, vocab
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, matchers: Sequence[tuple[int, "Matcher"]]) -> np.ndarray:
        mask_bw = full_masks(self.rows, self.vocab)
        fill_masks(mask_bw, matchers, self._llg())
        return mask_bw

    def start(self, matchers: Sequence[tuple[int, "Matcher"]], put: Callable[[np.ndarray], Any] | None = None
              ) -> "PendingMasks":
        """The masks of `matchers` (as `__call__` makes them), computed on a thread of this filler's while the
        caller goes on, then handed to `put` there (say, to copy them to the device): `PendingMasks.result` is
        what `put` returns (the array itself without one). The matchers must not advance until then."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsjax-masks")
        rows = list(matchers)
        return PendingMasks(self._pool.submit(self._fill, rows, put))

    def close(self) -> None:
        """Stop the thread `start` uses (a later `start` makes a new one)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _fill(self, rows: list[tuple[int, "Matcher"]], put) -> tuple[Any, list[tuple["Matcher", str]]]:
        mask_bw = full_masks(self.rows, self.vocab)
        failed = _failures(mask_bw, _fill_rows(mask_bw, rows, self._llg()))
        return (mask_bw if put is None else put(mask_bw)), failed

    def _llg(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor


class PendingMasks:
    """Masks being computed (`MaskFiller.start`)."""

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> Any:
        """The masks, once made; failures llguidance met are recorded on their matchers here, on the caller's
        thread (a consumer reading a matcher's `error` meanwhile sees it unchanged)."""
        masks, failed = self._future.result()
        _record(failed)
        return masks


def fill_masks(mask_bw: np.ndarray, rows: Sequence[tuple[int, "Matcher"]], executor: llguidance.LLExecutor | None = None
               ) -> None:
    """Fill each `(row, matcher)` row of `mask_bw` with the tokens its matcher allows next (a `Matcher`, or
    anything with its `mask_source`, such as a thinking budget). With an `executor`, llguidance computes the
    grammars' rows together on its own threads, without holding Python's lock."""
    _record(_failures(mask_bw, _fill_rows(mask_bw, rows, executor)))


def _fill_rows(mask_bw: np.ndarray, rows: Sequence[tuple[int, "Matcher"]], executor: llguidance.LLExecutor | None
               ) -> list[tuple["Matcher", int]]:
    """`fill_masks` before its check: the (grammar matcher, row) pairs llguidance filled."""
    pending = [(m, row) for row, obj in rows if (m := obj.mask_source(mask_bw, row)) is not None]
    if executor is not None and len(pending) > 1:
        llnp.fill_next_token_bitmask_par(executor, [(m._m, row) for m, row in pending], mask_bw)
    else:
        for m, row in pending:
            llnp.fill_next_token_bitmask(m._m, mask_bw, row)
    return pending


def _failures(mask_bw: np.ndarray, pending: list[tuple["Matcher", int]]) -> list[tuple["Matcher", str]]:
    """The failures llguidance met in the rows it just filled, a mask allowing nothing among them, as (matcher,
    message); those rows then allow only the stop tokens, so their responses end."""
    if not pending:
        return []
    empty = ~mask_bw[[row for _, row in pending]].any(axis=1)
    failed = []
    for (m, row), none in zip(pending, empty):
        if m._m.is_error():
            failed.append((m, m._m.get_error()))
        elif none:
            failed.append((m, "the grammar allows no token here"))
        else:
            continue
        only(mask_bw, row, m._stop_ids)
    return failed


def _record(failed: list[tuple["Matcher", str]]) -> None:
    for m, error in failed:
        m.error = error


def mask_words(vocab: int) -> int:
    """int32 words of one mask row."""
    return (vocab + 31) // 32


def full_masks(rows: int, vocab: int) -> np.ndarray:
    """`[rows, mask_words(vocab)]` masks that allow every token (rows without a constraint)."""
    return np.full((rows, mask_words(vocab)), -1, np.int32)


def only(mask_bw: np.ndarray, row: int, tokens: Sequence[int]) -> None:
    """Set row `row` of `mask_bw` to allow exactly `tokens`."""
    words = mask_bw[row].view(np.uint32)
    words[:] = 0
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))
