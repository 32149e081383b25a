"""The embedded model's corpus: the Python standard library's own sources, as chat conversations.

Every top-level function and class (and the methods of classes too long to show whole) becomes one
conversation: a user asks for it by name, the assistant thinks with its docstring's first sentence
and answers with its source in a fenced block. deepseek-recipe renders each conversation (V4.1 or V4
encoding, thinking on or off, chosen by the seed), so the model learns the real prompt format and the
thinking markers. The rendered token streams are packed into fixed-length rows; whole modules are held
out (1 in `heldout_every` by a hash of the module name), so held-out rows are code the model never saw.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import random
import sysconfig
import warnings
from typing import Iterator

import deepseek_recipe as dr
import numpy as np

MAX_SOURCE_CHARS = 3000
_SKIP_DIRS = {"site-packages", "__pycache__", "idlelib", "lib2to3", "turtledemo", "ensurepip", "venv"}

USER_TEMPLATES = (
    "Write the function `{name}` from the `{module}` module.",
    "Show me how `{module}.{name}` is implemented.",
    "Implement `{name}` as it is in Python's `{module}`.",
    "What does the source of `{name}` in `{module}` look like?",
)
CLASS_TEMPLATES = (
    "Write the class `{name}` from the `{module}` module.",
    "Show me how the class `{module}.{name}` is implemented.",
)


@dataclasses.dataclass(frozen=True)
class Example:
    module: str  # dotted module name, e.g. "urllib.parse"
    name: str  # "quote", or "Class.method"
    kind: str  # "function" or "class"
    source: str
    summary: str  # the docstring's first sentence, or a plain description


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def module_files(root: str) -> list[tuple[str, str]]:
    """(module name, path) of every `.py` file under `root`, sorted, skipping tools and vendored code."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if rel and all(part.isidentifier() for part in rel):
                out.append((".".join(rel), os.path.join(dirpath, fn)))
    return sorted(out)


def _summary(node: ast.AST, module: str, name: str, kind: str) -> str:
    doc = ast.get_docstring(node) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if first:
        end = first.find(". ")
        return (first if end < 0 else first[:end + 1])[:300]
    return f"`{name}` is a {kind} defined in `{module}`."


def examples_in(module: str, text: str) -> Iterator[Example]:
    """The functions and classes of one module's source (methods of classes too long to show whole)."""
    try:
        with warnings.catch_warnings():  # old escape sequences in some stdlib files
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        source = ast.get_source_segment(text, node, padded=True) or ""
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        if len(source) <= MAX_SOURCE_CHARS:
            yield Example(module, node.name, kind, source, _summary(node, module, node.name, kind))
        elif kind == "class":
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    src = ast.get_source_segment(text, sub) or ""
                    name = f"{node.name}.{sub.name}"
                    if 0 < len(src) <= MAX_SOURCE_CHARS:
                        yield Example(module, name, "function", src, _summary(sub, module, name, "method"))


def is_heldout(module: str, heldout_every: int) -> bool:
    digest = hashlib.sha256(module.encode()).digest()
    return int.from_bytes(digest[:4], "little") % heldout_every == 0


def conversation(example: Example, rng: random.Random) -> tuple[str, bool]:
    """(user prompt, thinking mode) for one example, drawn from `rng`."""
    templates = CLASS_TEMPLATES if example.kind == "class" else USER_TEMPLATES
    return rng.choice(templates).format(name=example.name, module=example.module), rng.random() < 0.7


def render(example: Example, rng: random.Random, encodings: dict[str, object], eos_id: int) -> list[int]:
    """Prompt and answer of one example as token ids, ending with EOS; the encoding and thinking mode
    are drawn from `rng` (V4.1 three times in four)."""
    prompt, thinking = conversation(example, rng)
    encoding = encodings["v4.1" if rng.random() < 0.75 else "v4"]
    answer = dr.AssistantMessage(f"```python\n{example.source.rstrip()}\n```",
                                 reasoning_content=example.summary if thinking else None, prefix=True)
    conv = dr.Conversation([dr.UserMessage(prompt), answer], thinking_mode=thinking)
    return list(encoding.encode(conv)) + [eos_id]


@dataclasses.dataclass
class Corpus:
    train: np.ndarray  # [N, seq_len] uint16
    heldout: np.ndarray  # [M, seq_len] uint16
    stats: dict


def split_examples(root: str, heldout_every: int = 40) -> tuple[dict[bool, list[Example]], int]:
    """The examples of every Python file under `root`, by whether their module is held out, and the file count."""
    split: dict[bool, list[Example]] = {False: [], True: []}
    n_files = 0
    for module, path in module_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        n_files += 1
        split[is_heldout(module, heldout_every)].extend(examples_in(module, text))
    return split, n_files


def build_corpus(tokenizer_path: str, seq_len: int, seed: int, root: str | None = None,
                 heldout_every: int = 40, max_heldout_rows: int = 16) -> Corpus:
    """Render, shuffle (by `seed`) and pack the stdlib's examples into rows of `seq_len` tokens."""
    root = root or stdlib_root()
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} does not exist")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source folder {root} does not exist")
    tokenizer = dr.Tokenizer.from_file(tokenizer_path)
    encodings = {"v4.1": dr.DeepseekV41Encoding().with_tokenizer(tokenizer),
                 "v4": dr.DeepseekV4Encoding().with_tokenizer(tokenizer)}
    eos_id = tokenizer.encode(dr.SpecialToken.Eos.default_str())[0]
    split, n_files = split_examples(root, heldout_every)
    if not split[False]:
        raise ValueError(f"no functions or classes found in the Python files under {root}")
    rng = random.Random(seed)
    rows, digests = {}, {}
    for held in (False, True):
        examples = split[held]
        rng.shuffle(examples)
        stream: list[int] = []
        for ex in examples:
            stream.extend(render(ex, rng, encodings, eos_id))
        n = len(stream) // seq_len
        if held:
            n = min(n, max_heldout_rows)
        rows[held] = np.asarray(stream[:n * seq_len], np.uint16).reshape(n, seq_len)
        digests[held] = hashlib.sha256(rows[held].tobytes()).hexdigest()
    stats = {"root": root, "files": n_files, "examples_train": len(split[False]),
             "examples_heldout": len(split[True]), "rows_train": int(len(rows[False])),
             "rows_heldout": int(len(rows[True])), "seq_len": seq_len, "seed": seed,
             "sha256_train": digests[False], "sha256_heldout": digests[True]}
    return Corpus(rows[False], rows[True], stats)
