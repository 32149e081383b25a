"""An OpenAI Batch input of N chat requests, for timing `dsjax generate` end to end.

    python scripts/make_requests.py OUT.jsonl --count 512 [--model DeepSeek-V4-Pro] [--words 200]
        [--max-tokens 64] [--seed 0]

Each request asks about a different run of random words (prompts of about `--words` words, varied ±50%),
with thinking off and `temperature` 0.7, so every request samples and none is cut short by a stop token
more often than the model makes one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

_WORDS = ("alpha beta gamma delta river stone light cloud paper engine garden window silver quiet orbit "
          "lantern copper meadow signal harbor thread forest marble candle winter summer ladder bridge").split()


def requests(count: int, model: str, words: int, max_tokens: int, seed: int):
    rng = random.Random(seed)
    for i in range(count):
        n = max(1, int(words * rng.uniform(0.5, 1.5)))
        text = " ".join(rng.choice(_WORDS) for _ in range(n))
        yield {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": model, "messages": [{"role": "user", "content": f"Summarise: {text}"}],
                        "max_tokens": max_tokens, "temperature": 0.7, "thinking": {"type": "disabled"}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--model", default="DeepSeek-V4-Pro", help="the served model name requests give")
    p.add_argument("--words", type=int, default=200, help="prompt words (about 1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.count < 1 or args.words < 1 or args.max_tokens < 1:
        p.error("--count, --words and --max-tokens must be positive")
    with open(args.out, "w") as f:
        for r in requests(args.count, args.model, args.words, args.max_tokens, args.seed):
            f.write(json.dumps(r) + "\n")
    print(f"{args.out}: {args.count} requests for {args.model!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
