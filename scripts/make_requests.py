"""An OpenAI Batch input of N chat requests, for timing `dsjax generate` end to end.

    python scripts/make_requests.py OUT.jsonl --count 512 [--model DeepSeek-V4-Pro] [--words 200]
        [--max-tokens 64] [--seed 0] [--images 546x546 1036x770 ...]
    python scripts/make_requests.py OUT.jsonl --mix 150:2000 3000:400 20000:90 180000:10 [...]

Each request asks about a different run of random words (prompts of about `--words` words, varied ±50%),
with thinking off and `temperature` 0.7, so every request samples and none is cut short by a stop token
more often than the model makes one. With `--images W×H ...`, each request also carries one random picture
(a PNG data URL, smooth colours plus noise) before its text, the sizes taken in turn: for models that
read images.

With `--stdlib-heldout`, the requests are instead the corpus's own kind of question about functions and classes
of the standard library's modules the embedded models never trained on (`dsjax.training.corpus`), at
temperature 0: for measuring what a trained model does, such as DSpark's acceptance.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys

_WORDS = ("alpha beta gamma delta river stone light cloud paper engine garden window silver quiet orbit "
          "lantern copper meadow signal harbor thread forest marble candle winter summer ladder bridge").split()


def picture(width: int, height: int, seed: int) -> str:
    """A random W×H picture as a PNG data URL: a colour gradient with a few soft blobs and pixel noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    pixels = 128 + 100 * (x[..., None] * rng.uniform(-1, 1, 3) + y[..., None] * rng.uniform(-1, 1, 3))
    for cx, cy, r, colour in zip(rng.uniform(0, 1, 4), rng.uniform(0, 1, 4), rng.uniform(0.05, 0.3, 4),
                                 rng.uniform(-80, 80, (4, 3))):
        pixels += colour * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / r ** 2)[..., None]
    pixels += rng.normal(0, 8, pixels.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def requests(count: int, model: str, words: int, max_tokens: int, seed: int,
             images: list[tuple[int, int]] | None = None, mix: list[tuple[int, int]] | None = None):
    """`count` requests of about `words` words (±50%); or with `mix` [(words, count), ...], that many of each
    size (±10%), in a shuffled order, as a job of mixed lengths comes."""
    rng = random.Random(seed)
    if mix:
        sizes = [w for w, c in mix for _ in range(c)]
        rng.shuffle(sizes)
        lengths = [max(1, int(w * rng.uniform(0.9, 1.1))) for w in sizes]
    else:
        lengths = [max(1, int(words * rng.uniform(0.5, 1.5))) for _ in range(count)]
    for i, n in enumerate(lengths):
        text = f"Summarise: {' '.join(rng.choice(_WORDS) for _ in range(n))}"
        content = text
        if images:
            url = picture(*images[i % len(images)], seed=seed * 1_000_003 + i)
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        yield {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": model, "messages": [{"role": "user", "content": content}],
                        "max_tokens": max_tokens, "temperature": 0.7, "thinking": {"type": "disabled"}}}


def heldout_requests(count: int, model: str, max_tokens: int, seed: int, root: str | None = None):
    """Greedy requests for `count` held-out stdlib examples, drawn by `seed` (their modules' order is the files')."""
    from dsjax.training.corpus import conversation, split_examples, stdlib_root

    examples = split_examples(root or stdlib_root())[0][True]
    if len(examples) < count:
        raise ValueError(f"--count {count}: the held-out modules have only {len(examples)} examples")
    rng = random.Random(seed)
    for i, ex in enumerate(rng.sample(examples, count)):
        prompt, _ = conversation(ex, rng)
        yield {"custom_id": f"heldout-{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": max_tokens, "temperature": 0.0, "thinking": {"type": "disabled"}}}


def size(text: str) -> tuple[int, int]:
    """`W×H` or `WxH` → (W, H)."""
    try:
        w, h = (int(v) for v in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 640x480") from None
    if not (0 < w <= 8192 and 0 < h <= 8192):
        raise argparse.ArgumentTypeError(f"{text!r}: sides must be 1 to 8192 pixels")
    return w, h


def mix_entry(text: str) -> tuple[int, int]:
    """`WORDS:COUNT` → (words, count), both positive."""
    try:
        words, count = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WORDS:COUNT, such as 200:1000") from None
    if words < 1 or count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: words and count must be positive")
    return words, count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--count", type=int, help="requests (required unless --mix gives them)")
    p.add_argument("--model", default="DeepSeek-V4-Pro", help="the served model name requests give")
    p.add_argument("--words", type=int, default=200, help="prompt words (about one token each with DeepSeek's tokenizer)")
    p.add_argument("--mix", nargs="+", type=mix_entry, metavar="WORDS:COUNT",
                   help="a job of mixed lengths instead of --count and --words: COUNT requests of about WORDS words "
                        "(±10%%) for each pair, shuffled")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", nargs="+", type=size, metavar="WxH",
                   help="one random picture per request, of these sizes in turn")
    p.add_argument("--stdlib-heldout", action="store_true",
                   help="greedy questions about held-out standard-library functions instead of random words")
    p.add_argument("--stdlib", help="with --stdlib-heldout: the standard library's folder (default: this Python's)")
    args = p.parse_args(argv)
    if args.mix:
        if args.count is not None or args.stdlib_heldout:
            p.error("--mix gives the requests' count and lengths: leave out --count and --stdlib-heldout")
        args.count = sum(c for _, c in args.mix)
    elif args.count is None:
        p.error("give --count, or --mix")
    if args.count < 1 or args.words < 1 or args.max_tokens < 1:
        p.error("--count, --words and --max-tokens must be positive")
    if args.stdlib_heldout and args.images:
        p.error("--stdlib-heldout requests carry no pictures: leave out --images")
    if args.stdlib and not args.stdlib_heldout:
        p.error("--stdlib is the folder --stdlib-heldout reads: give --stdlib-heldout too")
    try:
        made = list(heldout_requests(args.count, args.model, args.max_tokens, args.seed, args.stdlib)
                    if args.stdlib_heldout
                    else requests(args.count, args.model, args.words, args.max_tokens, args.seed, args.images,
                                  args.mix))
    except ValueError as e:
        p.error(str(e))
    with open(args.out, "w") as f:
        for r in made:
            f.write(json.dumps(r) + "\n")
    pictures = f", each with a picture ({len(args.images)} sizes)" if args.images else ""
    print(f"{args.out}: {args.count} requests for {args.model!r}{pictures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
