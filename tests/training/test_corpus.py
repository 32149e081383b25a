"""The stdlib corpus: examples from source, rendered through the recipe, packed, split by module."""

import random

import deepseek_recipe as dr
import numpy as np
import pytest

from dsjax.embedded import MODEL_DIR
from dsjax.training.corpus import (MAX_SOURCE_CHARS, build_corpus, examples_in, is_heldout, module_files,
                                   render)

SOURCE = '''
import os

def first(a, b=1):
    """Add two numbers. The rest of the docstring."""
    return a + b

class Small:
    def m(self):
        return 1

class Big:
    """A class too long to show whole."""
''' + "".join(f'''
    def method_{i}(self):
        """Method {i}."""
        return {i} + {"0" * 80}
''' for i in range(40))

TOKENIZER = f"{MODEL_DIR}/tokenizer.json"


def test_examples_are_functions_classes_and_methods_of_long_classes():
    assert len(SOURCE) > MAX_SOURCE_CHARS
    ex = {e.name: e for e in examples_in("pkg.mod", SOURCE)}
    assert set(ex) == {"first", "Small"} | {f"Big.method_{i}" for i in range(40)}
    assert ex["first"].summary == "Add two numbers."
    assert ex["first"].source.startswith("def first(a, b=1):") and ex["Small"].kind == "class"
    assert ex["Small"].summary == "`Small` is a class defined in `pkg.mod`."
    assert list(examples_in("broken", "def (:")) == []


def test_rendered_example_has_prompt_thinking_answer_and_eos():
    tok = dr.Tokenizer.from_file(TOKENIZER)
    enc = {"v4.1": dr.DeepseekV41Encoding().with_tokenizer(tok), "v4": dr.DeepseekV4Encoding().with_tokenizer(tok)}
    example = next(examples_in("pkg.mod", SOURCE))
    seen_thinking = set()
    for seed in range(12):
        ids = render(example, random.Random(seed), enc, eos_id=1)
        assert ids[0] == 0 and ids[-1] == 1 and 1 not in ids[:-1]
        think_end = tok.encode("</think>")[0]
        assert think_end in ids  # thinking or not, the answer follows </think>
        seen_thinking.add(tok.encode("<think>")[0] in ids)
    assert seen_thinking == {True, False}


def _fake_stdlib(root):
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text(SOURCE)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "vendored.py").write_text(SOURCE)
    for i in range(30):
        (root / f"mod{i}.py").write_text(SOURCE.replace("first", f"first_{i}"))
    (root / "not-a-module.py").write_text(SOURCE)


def test_corpus_is_reproducible_split_by_module_and_packed(tmp_path):
    _fake_stdlib(tmp_path)
    names = [m for m, _ in module_files(str(tmp_path))]
    assert "pkg" in names and "mod0" in names and not any("vendored" in n or "-" in n for n in names)
    a = build_corpus(TOKENIZER, 128, seed=3, root=str(tmp_path), heldout_every=4)
    b = build_corpus(TOKENIZER, 128, seed=3, root=str(tmp_path), heldout_every=4)
    c = build_corpus(TOKENIZER, 128, seed=4, root=str(tmp_path), heldout_every=4)
    np.testing.assert_array_equal(a.train, b.train)
    assert a.stats == b.stats and not np.array_equal(a.train, c.train)
    held = [m for m in names if is_heldout(m, 4)]
    assert 0 < len(held) < len(names)
    assert a.stats["examples_heldout"] == 42 * len(held)
    assert a.train.shape[1] == 128 and a.train.dtype == np.uint16 and len(a.heldout) <= 16
    assert a.train.max() < 8192


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="nope"):
        build_corpus(str(tmp_path / "nope.json"), 64, 0, root=str(tmp_path))


def test_a_folder_without_python_sources_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_corpus(TOKENIZER, 64, 0, root=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="no functions or classes"):
        build_corpus(TOKENIZER, 64, 0, root=str(tmp_path))
