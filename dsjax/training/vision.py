"""Teaching the embedded model to see: a synthetic task only an image can answer, and the encoder's training.

Each image is a random square picture: a grey, noisy background and one shape (circle, square or
triangle, anywhere, of any size from a quarter to a half of the side) in one of six colours. The
request asks "What colour is the shape?" with thinking off; the answer is the colour's name. Chance is
one in six.

Only the image encoder learns. The decoder's weights stay as they are, so text requests are answered
exactly as before. The encoder learns to write, at the image's placeholders, embeddings that lead the
frozen decoder to name the colour. Training prompts are made by the job's own recipe path
(`batch.recipe.Recipe.prepare`), so they are token for token the prompts `dsjax generate` runs.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsjax.batch.jobfile import ErrorInfo, InputLine
from dsjax.batch.recipe import Recipe
from dsjax.engine.pixels import decode_image, patchify
from dsjax.model import DeepseekV4

COLOURS = {"red": (215, 35, 35), "green": (35, 165, 50), "blue": (35, 70, 215), "yellow": (235, 215, 40),
           "purple": (135, 45, 170), "orange": (240, 135, 25)}
QUESTION = "What colour is the shape?"
MODEL_NAME = "DeepSeek-V4.1-Flash"


def shape_image(rng: np.random.Generator) -> tuple[bytes, str]:
    """A PNG of one coloured shape on a noisy grey background, and the shape's colour name."""
    from PIL import Image, ImageDraw

    side = int(rng.integers(48, 129))
    grey = int(rng.integers(0, 256))
    noise = rng.integers(-20, 21, (side, side, 1))
    img = Image.fromarray(np.clip(grey + noise, 0, 255).repeat(3, axis=2).astype(np.uint8))
    name = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    fill = tuple(int(c) for c in np.clip(np.asarray(COLOURS[name]) + rng.integers(-20, 21, 3), 0, 255))
    size = int(rng.integers(side // 4, side // 2 + 1))
    x, y = (int(v) for v in rng.integers(0, side - size + 1, 2))
    draw = ImageDraw.Draw(img)
    kind = int(rng.integers(3))
    if kind == 0:
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif kind == 1:
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue(), name


def shape_request(custom_id: str, png: bytes, max_tokens: int = 4) -> dict:
    """The batch line that asks for the shape's colour (chat completions, thinking off, greedy)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL_NAME, "thinking": {"type": "disabled"}, "temperature": 0,
                     "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                               {"type": "text", "text": QUESTION}]}]}}


def answer_of(record: dict) -> str:
    """The answer text of a chat completions result record ('' for an error record)."""
    if record.get("error"):
        return ""
    return (record["response"]["body"]["choices"][0]["message"].get("content") or "").strip().lower()


@dataclasses.dataclass
class Batch:
    tokens_bt: np.ndarray  # prompt, answer and end of sequence, padded with end of sequence
    loss_bt: np.ndarray  # positions whose next token is scored (the answer's and the first end's)
    patches_bnk: np.ndarray
    image_start: int
    colours: list[str]


class ShapeData:
    """Batches of the task, built through the job's recipe (prompts as `dsjax generate` makes them)."""

    def __init__(self, recipe: Recipe, eos: int, seed: int):
        self.recipe, self.eos = recipe, eos
        self.rng = np.random.default_rng(seed)
        self.answers = {name: recipe.tokenizer.encode(name) for name in COLOURS}
        self.grid = None

    def batch(self, n: int) -> Batch:
        rows, patches, colours = [], [], []
        for i in range(n):
            png, name = shape_image(self.rng)
            prep = self.recipe.prepare(InputLine(i, "x", "/v1/chat/completions", shape_request("x", png)["body"]))
            if isinstance(prep, ErrorInfo) or len(prep.images) != 1:
                raise RuntimeError(f"the recipe did not prepare the task's request: {prep}")
            span = prep.images[0]
            pixels = decode_image(span.data, self.recipe.vision)
            arrays = patchify(pixels, self.recipe.vision)
            grid = (span.start, *self.recipe.vision.grid(pixels.shape[1], pixels.shape[0]), arrays["row"].tobytes(),
                    len(prep.prompt))
            if self.grid is None:
                self.grid, self.arrays = grid, arrays
            elif grid != self.grid:  # square images all come back at one size, with one prompt
                raise RuntimeError("the task's images did not all preprocess to one size")
            rows.append(prep.prompt + self.answers[name] + [self.eos])
            patches.append(arrays["patches"])
            colours.append(name)
        width = max(len(r) for r in rows)
        prompt_len = self.grid[4]
        tokens = np.full((n, width), self.eos, np.int32)
        loss = np.zeros((n, width), bool)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
            loss[i, prompt_len - 1:len(r) - 1] = True
        return Batch(tokens, loss, np.stack(patches), self.grid[0], colours)


def _is_encoder_param(path, var) -> bool:
    return bool(path) and path[0] == "vision" and isinstance(var, nnx.Param)


def train_encoder(model: DeepseekV4, data: ShapeData, steps: int, batch_size: int = 8, learning_rate: float = 2e-3,
                  log: Callable[[dict], None] = print, eval_every: int = 50) -> DeepseekV4:
    """Train `model.vision` (only) on `data`; the decoder's weights are not touched. Logs the loss and the
    teacher-forced answer accuracy (every answer token the decoder's first choice) on a held-out batch."""
    if model.vision is None:
        raise ValueError("the model has no image encoder to train (its config has no vision_config)")
    graphdef, params, frozen = nnx.split(model, _is_encoder_param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(20, steps // 4), steps, learning_rate / 20)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = tx.init(params)
    heldout = data.batch(4 * batch_size)
    start, rows, cols = data.grid[0], data.grid[1], data.grid[2]
    arrays = data.arrays
    fixed = tuple(jnp.asarray(arrays[k]) for k in ("row", "col", "valid"))

    def outputs(params, tokens_bt, patches_bnk):
        m = nnx.merge(graphdef, params, frozen)
        embeds = jax.vmap(lambda p: m.vision(p, *fixed, rows, cols))(patches_bnk)  # [B, image tokens, H]
        b, t = tokens_bt.shape
        n = embeds.shape[1]
        full = jnp.zeros((b, t, embeds.shape[-1]), embeds.dtype).at[:, start:start + n].set(embeds)
        mask = jnp.zeros((b, t), bool).at[:, start:start + n].set(True)
        return m.forward(tokens_bt, spliced=(full, mask))

    def loss_fn(params, tokens_bt, loss_bt, patches_bnk):
        logits = outputs(params, tokens_bt, patches_bnk)[:, :-1]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens_bt[:, 1:, None], axis=-1)[..., 0]
        mask = loss_bt[:, :-1]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    @jax.jit
    def step(params, opt_state, tokens_bt, loss_bt, patches_bnk):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_bt, loss_bt, patches_bnk)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def correct(params, tokens_bt, loss_bt, patches_bnk):
        picks = jnp.argmax(outputs(params, tokens_bt, patches_bnk)[:, :-1], axis=-1)
        hit = (picks == tokens_bt[:, 1:]) | ~loss_bt[:, :-1]
        return jnp.all(hit, axis=-1)

    def evaluate(params) -> float:
        return float(np.mean(np.asarray(correct(params, heldout.tokens_bt, heldout.loss_bt, heldout.patches_bnk))))

    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        b = data.batch(batch_size)
        params, opt_state, loss = step(params, opt_state, b.tokens_bt, b.loss_bt, b.patches_bnk)
        if i % eval_every == 0 or i == steps:
            log({"step": i, "loss": round(float(loss), 4), "heldout_answer_accuracy": evaluate(params),
                 "seconds": round(time.perf_counter() - t0, 1)})
    return nnx.merge(graphdef, params, frozen)


def task_accuracy(model_dir: str, n: int, seed: int, workdir: str, **job) -> dict:
    """Ask `dsjax generate` (the real job) about `n` fresh images from `seed`; the share of answers that
    name the shape's colour, with the per-colour counts. `job`: JobConfig settings."""
    import json
    import os

    from dsjax.batch.job import JobConfig, run_job

    rng = np.random.default_rng(seed)
    truth = {}
    inp, out = os.path.join(workdir, "shapes.jsonl"), os.path.join(workdir, "shapes.out.jsonl")
    with open(inp, "w") as f:
        for i in range(n):
            png, name = shape_image(rng)
            truth[f"shape-{i}"] = name
            f.write(json.dumps(shape_request(f"shape-{i}", png)) + "\n")
    summary = run_job(JobConfig(model=model_dir, input=inp, output=out, **job))
    with open(out) as f:
        records = [json.loads(line) for line in f]
    answers = {r["custom_id"]: answer_of(r) for r in records}
    per_colour = {c: [0, 0] for c in COLOURS}
    for cid, name in truth.items():
        per_colour[name][0] += answers.get(cid) == name
        per_colour[name][1] += 1
    right = sum(hit for hit, _ in per_colour.values())
    return {"images": n, "accuracy": right / n, "chance": 1 / len(COLOURS),
            "per_colour": {c: f"{hit}/{total}" for c, (hit, total) in per_colour.items()},
            "errors": sum(1 for r in records if r.get("error")), "records": records,
            "wall_seconds": summary["wall_seconds"]}
