"""`scripts/make_requests.py`: N distinct chat requests the batch job takes."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_requests.py"
spec = importlib.util.spec_from_file_location("make_requests", SCRIPT)
make = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make)


def test_requests_are_distinct_valid_lines(tmp_path):
    from dsjax.batch.jobfile import read_lines

    out = tmp_path / "in.jsonl"
    assert make.main([str(out), "--count", "20", "--model", "m", "--words", "10", "--max-tokens", "3"]) == 0
    lines = list(read_lines(str(out)))
    assert len(lines) == 20 and all(x.error is None and x.body["model"] == "m" for x in lines)
    assert len({json.dumps(x.body["messages"]) for x in lines}) == 20
    with pytest.raises(SystemExit):
        make.main([str(out), "--count", "0"])


def test_requests_carry_pictures_of_the_given_sizes(tmp_path):
    """`--images`: one PNG data URL per request before its text, the sizes in turn, distinct pictures; a size
    that is not W×H is refused."""
    import base64
    import io

    from PIL import Image

    out = tmp_path / "in.jsonl"
    assert make.main([str(out), "--count", "5", "--words", "4", "--images", "64x48", "30×90"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    seen = set()
    for i, row in enumerate(rows):
        image, text = row["body"]["messages"][0]["content"]
        assert image["type"] == "image_url" and text["type"] == "text" and text["text"].startswith("Summarise: ")
        head, data = image["image_url"]["url"].split(",", 1)
        assert head == "data:image/png;base64"
        with Image.open(io.BytesIO(base64.b64decode(data))) as img:
            assert img.size == [(64, 48), (30, 90)][i % 2] and img.mode == "RGB"
            seen.add(img.tobytes())
    assert len(seen) == 5
    for bad in ("64", "0x10", "axb"):
        with pytest.raises(SystemExit):
            make.main([str(out), "--count", "1", "--images", bad])


def test_heldout_requests_ask_about_held_out_modules_greedily(tmp_path):
    """`--stdlib-heldout`: greedy questions about functions of the modules the corpus holds out (here of a small
    source tree), drawn by the seed; more than the held-out modules hold, or pictures with them, are refused."""
    from dsjax.training.corpus import is_heldout

    root = tmp_path / "lib"
    root.mkdir()
    names = [f"mod{i}" for i in range(400)]
    held = [n for n in names if is_heldout(n, 40)][:3]
    for n in names[:30] + held:
        (root / f"{n}.py").write_text(f'def first_{n}(x):\n    """Do one."""\n    return x\n\n\n'
                                      f'def second_{n}(y):\n    """Do two."""\n    return y\n')
    out = tmp_path / "in.jsonl"
    args = [str(out), "--count", "6", "--stdlib-heldout", "--stdlib", str(root), "--max-tokens", "7", "--seed", "3"]
    assert make.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["body"]["temperature"] == 0.0 and r["body"]["max_tokens"] == 7 for r in rows)
    prompts = [r["body"]["messages"][0]["content"] for r in rows]
    assert len(set(prompts)) == 6 and all(any(f"_{n}" in p and n in p for n in held) for p in prompts), prompts
    again = tmp_path / "again.jsonl"
    make.main([str(again)] + args[1:])
    assert again.read_text() == out.read_text()
    for bad in (["--count", "7"], ["--count", "2", "--images", "8x8"]):
        with pytest.raises(SystemExit):
            make.main([str(out), "--stdlib-heldout", "--stdlib", str(root)] + bad)
    with pytest.raises(SystemExit):
        make.main([str(out), "--count", "2", "--stdlib", str(root)])


def test_a_mix_of_lengths_gives_each_size_its_count_shuffled(tmp_path):
    from dsjax.batch.jobfile import read_lines

    out = tmp_path / "mix.jsonl"
    assert make.main([str(out), "--mix", "10:30", "200:5", "1000:2", "--model", "m"]) == 0
    lines = list(read_lines(str(out)))
    words = [len(x.body["messages"][0]["content"].split()) - 1 for x in lines]  # "Summarise:" and the words
    assert len(lines) == 37 and [x.custom_id for x in lines] == [f"req-{i}" for i in range(37)]
    sizes = {10: [w for w in words if w <= 11], 200: [w for w in words if 180 <= w <= 220],
             1000: [w for w in words if 900 <= w <= 1100]}
    assert [len(v) for v in sizes.values()] == [30, 5, 2]
    assert [w <= 11 for w in words] != [True] * 30 + [False] * 7  # shuffled, not in the order given
    for bad in (["--mix", "10"], ["--mix", "10:0"], ["--mix", "10:3", "--count", "3"]):
        with pytest.raises(SystemExit):
            make.main([str(tmp_path / "bad.jsonl"), *bad])
    assert not (tmp_path / "bad.jsonl").exists()
