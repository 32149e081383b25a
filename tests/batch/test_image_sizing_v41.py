"""Does deepseek-recipe 0.2.0 prepare images the way DeepSeek-V4.1's release does (deepseek_v41_spec.md §6)?

`release_layout` below is the release's sizing rule written from the spec and DeepInfer 0.1.0's processor:
minimum-pixel upscale (integer truncation), sides rounded up to multiples of 14, the 1,024-token cap with
its aspect-preserving solve, one pass. It is checked against DeepInfer's own `compute_image_layout` (the
function's source, taken from the DeepInfer tarball in /work/shared/reference/third_party and run here
without its GPU dependencies) and against NeMo AutoModel's `_plan_image_grid` (run in `.venv-ref41`).

What the tests establish about the recipe (`ImageResolver(ReqwestImageFetcher, OpenCvImagePreprocessor)`,
as `dsjax.batch.images.ImageResolver` builds it):
- `ImageInfo.data` is the whole padded canvas, encoded as *lossy* WebP (`VP8 ` chunk, quality 90), RGB;
  `ImageInfo.width`/`height` are the canvas size, which is a fixed point of the release's rule, so the
  token count of (width, height), h·(w+1)+2, is the recipe's `image_token_adjustment() + 1`.
- The content is resized with aspect kept and centred (offsets rounded half to even, as PIL's
  `ImageOps.pad`) on gray 127: the same placement as NeMo's canvas. Inside the content, pixels differ from
  NeMo's by about what WebP's loss alone gives (smooth content).
- Sizes and tokens equal the release's for every sampled size but two kinds, which the recipe gets wrong:
  1. some images under the minimum pixels with an aspect ratio over 4 (2.5% of all sizes under the minimum
     with sides up to 3,000; none with an aspect ratio within 4): the recipe repeats the rule until the size
     stops changing, the release applies it once, and its canvas is then not a fixed point. The recipe's
     canvas is longer along the long side (by 14 pixels or more; the short side and the fitted content stay
     the same, only the padding grows), with up to 18 more tokens (sides up to 3,000) or the same tokens:
     1×41 → the release 84×3486 (251 tokens), the recipe 84×3528 (254); 1×352 → 28×10206 (488) against
     28×10570 (506); 2100×90 → 2632×112 against 2646×112 (194 both).
  2. sizes whose release canvas has a side over 16,383 pixels (WebP's limit; aspect ratios beyond about
     900:1): the recipe shrinks them, e.g. 1×8192 → the release 42×21462 (1,024 tokens), the recipe
     42×16380 (782 tokens); 8192×1 → 42882×42 (1,024) against 16380×28 (393).
- Other differences from the release's preparation: the recipe downscales with OpenCV's INTER_CUBIC without
  antialiasing (PIL's BICUBIC, which DeepInfer and NeMo use, antialiases): 1-pixel stripes downscaled come
  out as strong moiré instead of flat gray; transparent pixels are blended onto #FDFDFD (PIL's
  `convert("RGB")` drops alpha); `detail: "low"` first shrinks the long side to 512 pixels; sides over 8,192
  pixels (4,096 once a request has 15 images) are refused.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import math
import os
import random
import subprocess
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import deepseek_recipe as dr
import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from tests.conftest import reference_v41_python

PATCH, DOWNSAMPLE, MAX_TOKENS, MIN_PIXELS = 14, 3, 1024, 544 * 544  # the release's vision_config
PAD_GRAY = 127  # int(mean 0.5 · 255)
WEBP_MAX_SIDE = 16383  # the largest side a WebP image can have
RECIPE_MAX_SIDE, RECIPE_MAX_SIDE_MANY, RECIPE_MANY_IMAGES = 8192, 4096, 15
RECIPE_LOW_DETAIL_SIDE = 512
DEEPINFER_TARBALL = Path("/work/shared/reference/third_party/deepinfer-0.1.0.tar.gz")
DEEPINFER_MEMBER = "deepinfer-0.1.0/deepinfer/ve/processor/image_processor.py"


# ---------------------------------------------------------------------------------------------------------
# The test-side oracle: the release's sizing rule (spec §6), and the recipe's departures from it


class Layout(NamedTuple):
    width: int  # the canvas the image is fitted into
    height: int
    n_llm_h: int
    n_llm_w: int
    tokens: int  # n_llm_h·(n_llm_w + 1) + 2


def _grid(width: int, height: int) -> Layout:
    n_llm_h = -(-(height // PATCH) // DOWNSAMPLE)
    n_llm_w = -(-(width // PATCH) // DOWNSAMPLE)
    return Layout(width, height, n_llm_h, n_llm_w, n_llm_h * (n_llm_w + 1) + 2)


def release_layout(width: int, height: int) -> Layout:
    """The release's canvas and token grid for a width×height image (max_wh_ratio null: no width clamp)."""
    w, h = width, height
    if 0 < w * h < MIN_PIXELS:  # upscale to the minimum area, truncating
        scale = math.sqrt(MIN_PIXELS / (w * h))
        w, h = int(w * scale), int(h * scale)
    layout = _grid(-(-w // PATCH) * PATCH, -(-h // PATCH) * PATCH)
    if layout.tokens <= MAX_TOKENS:
        return layout
    # The largest grid with the image's aspect and h·(w+1) ≤ 1022: h = a·w, a·w² + a·w = 1022.
    aspect, cell = h / w, PATCH * DOWNSAMPLE
    max_w = math.sqrt((MAX_TOKENS - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1:  # one column
        return _grid(cell, (MAX_TOKENS - 2) // 2 * cell)
    if max_h < 1:  # one row
        return _grid((MAX_TOKENS - 3) * cell, cell)
    beta = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
    return _grid(math.floor(w * beta / PATCH) * PATCH, math.floor(h * beta / PATCH) * PATCH)


def content_box(width: int, height: int, canvas_w: int, canvas_h: int) -> tuple[int, int, int, int]:
    """(left, top, w, h) of the image inside its canvas: fitted with its aspect kept (the other side
    rounded), centred with the offsets rounded half to even (Python's round, as PIL's ImageOps.pad)."""
    if width * canvas_h > canvas_w * height:  # wider than the canvas: full width
        w, h = canvas_w, max(1, round(height / width * canvas_w))
    elif width * canvas_h < canvas_w * height:
        w, h = max(1, round(width / height * canvas_h)), canvas_h
    else:
        w, h = canvas_w, canvas_h
    return round((canvas_w - w) / 2), round((canvas_h - h) / 2), w, h


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def recipe_layout(width: int, height: int) -> Layout:
    """What deepseek-recipe 0.2.0 gives, as measured: the release's rule repeated until the size stops
    changing, and a canvas with a side over WebP's limit shrunk into it (long side to the largest multiple
    of 14 within it, short side scaled and rounded up to a multiple of 14), then fitted again."""
    size = (width, height)
    for _ in range(6):
        layout = release_layout(*size)
        for _ in range(10):
            again = release_layout(layout.width, layout.height)
            if again == layout:
                break
            layout = again
        else:
            raise AssertionError(f"no fixed point from {size}")
        if max(layout.width, layout.height) <= WEBP_MAX_SIDE:
            return layout
        long_side, short_side = max(layout.width, layout.height), min(layout.width, layout.height)
        new_long = WEBP_MAX_SIDE // PATCH * PATCH
        new_short = -(-max(1, _round_half_up(short_side * new_long / long_side)) // PATCH) * PATCH
        size = (new_long, new_short) if layout.width >= layout.height else (new_short, new_long)
    raise AssertionError(f"no size within the WebP limit from {width}x{height}")


# ---------------------------------------------------------------------------------------------------------
# The recipe, as dsjax.batch.images.ImageResolver builds it (no remote fetching is involved: data URLs)

_RESOLVER = dr.ImageResolver(dr.ReqwestImageFetcher.with_max_bytes(64 << 20), dr.OpenCvImagePreprocessor())


def png(pixels_or_image) -> bytes:
    img = pixels_or_image if isinstance(pixels_or_image, Image.Image) else Image.fromarray(pixels_or_image)
    out = io.BytesIO()
    img.save(out, "PNG", compress_level=1)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def resolve(*images: bytes, detail: str = "high") -> dr.MultiModalData:
    return _RESOLVER.resolve([dr.DataUrlImageSource(data_url(d), detail) for d in images], dr.ImageQuota())


def decode(info: dr.ImageInfo) -> np.ndarray:
    with Image.open(io.BytesIO(info.data)) as img:
        return np.asarray(img.convert("RGB"))


def smooth_content(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth RGB content (a few periods across the image) whose R and G stay far from the pad gray."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / width, y / height
    r = 50 + 50 * np.sin(2 * np.pi * (1.3 * u + 0.4 * v) + seed)  # [0, 100]
    g = 200 + 50 * np.cos(2 * np.pi * (0.5 * u - 1.1 * v) + 2 * seed)  # [150, 250]
    b = 127 + 100 * np.sin(2 * np.pi * (2 * u * v + 0.7 * u) + seed)
    return np.clip(np.rint(np.stack([r, g, b], -1)), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------
# Sizes


def sample_sizes(n: int = 200, seed: int = 0) -> list[tuple[int, int]]:
    """`n` image sizes (width, height), seeded: fixed edge cases, then tiny images, images under the minimum
    pixels (aspect ratios within 4 and beyond), ordinary ones, ones over the token cap, long thin ones and
    strips 1-5 pixels wide, up to the recipe's 8,192-pixel sides."""
    rng = random.Random(seed)
    sizes = [(1, 1), (14, 14), (42, 42), (544, 544), (543, 545), (545, 543), (1540, 1092), (8192, 8192),
             (1, 41), (41, 1), (1, 352), (2, 165), (1, 8192), (8192, 1), (8192, 2), (3, 5000), (1439, 1)]

    def log_uniform(lo: float, hi: float) -> float:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    def by_area(area: float, aspect: float) -> tuple[int, int]:
        return max(1, round(math.sqrt(area * aspect))), max(1, round(math.sqrt(area / aspect)))

    kinds = ("tiny", "small", "small thin", "small thin", "ordinary", "capped", "long", "strip")
    while len(sizes) < n:
        kind = kinds[len(sizes) % len(kinds)]
        if kind == "tiny":
            w, h = rng.randint(1, 16), rng.randint(1, 16)
        elif kind == "small":
            w, h = by_area(log_uniform(50, MIN_PIXELS - 1), log_uniform(1, 4))
        elif kind == "small thin":
            w, h = by_area(log_uniform(20, MIN_PIXELS - 1), log_uniform(4, 600))
        elif kind == "ordinary":
            w, h = round(log_uniform(300, 1400)), round(log_uniform(300, 1400))
        elif kind == "capped":
            w, h = by_area(log_uniform(1.9e6, 5e6), log_uniform(1, 3))
        elif kind == "long":
            w, h = round(log_uniform(2000, RECIPE_MAX_SIDE)), round(log_uniform(20, 500))
        else:
            w, h = rng.choice((1, 2, 3, 5)), round(log_uniform(10, RECIPE_MAX_SIDE))
        w, h = min(w, RECIPE_MAX_SIDE), min(h, RECIPE_MAX_SIDE)
        sizes.append((w, h) if rng.random() < 0.5 else (h, w))
    return sizes


SIZES = sample_sizes()


def _resolve_size(size: tuple[int, int]) -> tuple[int, int, int, tuple[int, int], bytes]:
    """(width, height, tokens, decoded size, first 16 bytes) the recipe gives a solid PNG of `size`."""
    w, h = size
    mode, color = ("L", 90) if w * h > 1_000_000 else ("RGB", (10, 200, 30))  # grayscale: faster
    data = resolve(png(Image.new(mode, size, color)))
    (info,) = data.images
    with Image.open(io.BytesIO(info.data)) as img:
        decoded = img.size
    return info.width, info.height, data.image_token_adjustment() + 1, decoded, info.data[:16]


@pytest.fixture(scope="module")
def recipe_results():
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:  # the recipe releases the GIL
        results = dict(zip(SIZES, pool.map(_resolve_size, SIZES)))
    print(f"\nthe recipe resolved {len(SIZES)} images in {time.perf_counter() - start:.1f} s")
    return results


# ---------------------------------------------------------------------------------------------------------
# NeMo AutoModel's processing.py, run in .venv-ref41

_NEMO_HARNESS = r'''
import json, sys, types
import numpy as np
from nemo_automodel.components.models.deepseek_v41 import processing
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig

cfg = DeepseekV41VisionConfig()  # patch 14, downsample 3, 1024 tokens, min_pixels 295936, max_wh_ratio None
assert (cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens, cfg.min_pixels, cfg.max_wh_ratio) == (
    14, 3, 1024, 295936, None)
job = json.load(open(sys.argv[1]))
out = {}
grids = []
for w, h in job["sizes"]:
    g = processing._plan_image_grid(w, h, cfg)
    grids.append([g.width, g.height, g.llm_height, g.llm_width, g.llm_height * (g.llm_width + 1) + 2])
out["grids"] = np.array(grids, np.int64).reshape(-1, 5)
# _preprocess_image as is; ImageOps.pad wrapped only to keep the uint8 canvas it makes
canvases, real = [], processing.ImageOps
processing.ImageOps = types.SimpleNamespace(pad=lambda *a, **k: canvases.append(real.pad(*a, **k)) or canvases[-1])
for i, path in enumerate(job["images"]):
    with open(path, "rb") as f:
        patches, grid = processing._preprocess_image(f.read(), cfg)
    out[f"canvas_{i}"] = np.asarray(canvases[-1])
    out[f"patches_{i}"] = patches.float().numpy()
    out[f"grid_{i}"] = np.array([grid.width, grid.height, grid.vit_height, grid.vit_width])
np.savez(sys.argv[2], **out)
'''

# The images compared with NeMo's canvases: smooth content of five sizes (padding below/above, right/left,
# none; upscaled and downscaled), then one with transparency and 1-pixel stripes to be downscaled.
CANVAS_SIZES = [(640, 480), (300, 200), (123, 457), (3000, 2000), (1000, 300)]


def _transparent_image() -> np.ndarray:
    rgba = np.zeros((300, 400, 4), np.uint8)  # fully transparent black...
    rgba[:, :200] = (200, 40, 40, 255)  # ...but the left half, opaque red
    return rgba


def _stripes() -> np.ndarray:
    return np.broadcast_to(np.where(np.arange(3000) % 2 == 0, 0, 255).astype(np.uint8), (2000, 3000)).copy()


@pytest.fixture(scope="module")
def canvas_images() -> list[bytes]:
    images = [png(smooth_content(w, h, i)) for i, (w, h) in enumerate(CANVAS_SIZES)]
    return images + [png(_transparent_image()), png(_stripes())]


@pytest.fixture(scope="module")
def nemo(tmp_path_factory, canvas_images):
    """NeMo's `_plan_image_grid` for SIZES (`grids`), and for `canvas_images` its padded uint8 canvas
    (`canvas_<i>`) and bf16 patches as float32 (`patches_<i>`)."""
    py = reference_v41_python()
    if not os.path.exists(py):
        pytest.fail(f"the V4.1 reference environment is missing: {py} does not exist. Create it with "
                    "`bash .ci/setup` or point DSJAX_REF41_PYTHON at it.")
    folder = tmp_path_factory.mktemp("nemo-images")
    paths = []
    for i, data in enumerate(canvas_images):
        paths.append(str(folder / f"image{i}.png"))
        Path(paths[-1]).write_bytes(data)
    (folder / "job.json").write_text(json.dumps({"sizes": SIZES, "images": paths}))
    (folder / "harness.py").write_text(_NEMO_HARNESS)
    proc = subprocess.run([py, str(folder / "harness.py"), str(folder / "job.json"), str(folder / "out.npz")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"NeMo's processing.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(np.load(folder / "out.npz"))


# ---------------------------------------------------------------------------------------------------------
# The oracle against DeepInfer's and NeMo's processors


def _deepinfer_sizing():
    """DeepInfer 0.1.0's `compute_image_layout` and the functions it calls, taken from the tarball's
    image_processor.py and run without the module's torch/PIL/deepinfer imports (none of them is used)."""
    if not DEEPINFER_TARBALL.exists():
        pytest.skip(f"{DEEPINFER_TARBALL} is missing")
    with tarfile.open(DEEPINFER_TARBALL) as tar:
        source = tar.extractfile(DEEPINFER_MEMBER).read().decode()
    wanted = {"ImageLayout", "expanded_image_token_len", "_layout_from_pixels", "solve_resize_ratio", "safe_resize",
              "compute_image_layout"}
    tree = ast.parse(source)
    body = [node for node in tree.body if getattr(node, "name", None) in wanted]
    assert {node.name for node in body} == wanted, "DeepInfer's image_processor.py changed"
    namespace = {"__name__": "deepinfer_sizing"}
    exec("from __future__ import annotations\nimport math\nfrom typing import NamedTuple", namespace)
    exec(compile(ast.Module(body=body, type_ignores=[]), DEEPINFER_MEMBER, "exec"), namespace)
    return namespace["compute_image_layout"]


def test_oracle_matches_deepinfers_sizing():
    compute_image_layout = _deepinfer_sizing()
    rng = random.Random(1)
    sizes = set(SIZES)
    sizes |= {(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(3000)}
    sizes |= {(rng.randint(1, 40), rng.randint(1, 8192)) for _ in range(1000)}
    sizes |= {(w, h) for w in range(1, 30) for h in range(1, 30)}
    sizes |= {(h, w) for w, h in sizes}
    for w, h in sorted(sizes):
        di = compute_image_layout(w, h, patch_size=PATCH, downsample_ratio=DOWNSAMPLE, max_n_token=MAX_TOKENS,
                                  min_pixels=MIN_PIXELS, max_wh_ratio=None)
        assert release_layout(w, h) == (di.best_width, di.best_height, di.n_llm_h, di.n_llm_w, di.num_tokens), (w, h)


def test_oracle_matches_nemos_sizing(nemo):
    ours = np.array([release_layout(w, h) for w, h in SIZES])
    bad = [(size, tuple(o), tuple(n)) for size, o, n in zip(SIZES, ours, nemo["grids"]) if (o != n).any()]
    assert not bad, f"(size, ours, NeMo's): {bad[:10]}"


# ---------------------------------------------------------------------------------------------------------
# Sizes and tokens


def test_recipe_sizes_and_tokens_against_the_release(recipe_results):
    """For 200 sizes: the recipe's canvas and tokens equal the release's, but for the two kinds of size
    the module docstring names, where they equal `recipe_layout`'s."""
    departures = []
    for (w, h), (rw, rh, tokens, decoded, head) in recipe_results.items():
        assert head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8 ", (w, h, head)  # lossy WebP
        assert decoded == (rw, rh), (w, h)  # .data is the canvas, not only the resized image
        assert rw % PATCH == 0 and rh % PATCH == 0, (w, h, rw, rh)
        # What dsjax relies on: the canvas is a fixed point of the release's rule, so the tokens of
        # (width, height) are the recipe's.
        assert release_layout(rw, rh) == _grid(rw, rh) and _grid(rw, rh).tokens == tokens, (w, h, rw, rh)
        assert (rw, rh, tokens) == tuple(recipe_layout(w, h)[i] for i in (0, 1, 4)), (w, h)
        release = release_layout(w, h)
        if (rw, rh, tokens) != (release.width, release.height, release.tokens):
            fixed_point = release_layout(release.width, release.height) == release
            departures.append(((w, h), (release.width, release.height, release.tokens), (rw, rh, tokens),
                               "over WebP's limit" if max(release.width, release.height) > WEBP_MAX_SIDE else
                               "not a fixed point" if not fixed_point else "?"))
    print("\nsize, the release's (w, h, tokens), the recipe's, why:\n" + "\n".join(map(str, departures)))
    assert all(why != "?" for *_, why in departures)
    # The departures are exactly the sizes where the release's canvas is over WebP's limit or not a fixed
    # point of its own rule: images under the minimum area with an aspect ratio over 4.
    for w, h in SIZES:
        release = release_layout(w, h)
        if release_layout(release.width, release.height) != release:
            assert w * h < MIN_PIXELS and max(w / h, h / w) > 4, (w, h)
    kinds = {why for *_, why in departures}
    assert kinds == {"over WebP's limit", "not a fixed point"}, kinds  # the sample holds both kinds


@pytest.mark.parametrize("size, release, recipe", [
    ((1, 41), (84, 3486, 251), (84, 3528, 254)),
    ((41, 1), (3486, 84, 170), (3528, 84, 172)),
    ((1, 352), (28, 10206, 488), (28, 10570, 506)),
    ((2100, 90), (2632, 112, 194), (2646, 112, 194)),  # the canvas only
    ((1, 8192), (42, 21462, 1024), (42, 16380, 782)),
    ((8192, 1), (42882, 42, 1024), (16380, 28, 393)),
])
def test_where_the_recipe_departs_from_the_release(size, release, recipe):
    ours = release_layout(*size)
    assert (ours.width, ours.height, ours.tokens) == release
    data = resolve(png(Image.new("RGB", size, (10, 200, 30))))
    (info,) = data.images
    assert (info.width, info.height, data.image_token_adjustment() + 1) == recipe


def test_exif_orientation_is_ignored_as_by_the_release():
    """Neither the recipe nor the release's processors (PIL without exif_transpose) turn the image."""
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    out = io.BytesIO()
    Image.new("RGB", (600, 300), (200, 10, 10)).save(out, "JPEG", exif=exif.tobytes())
    (info,) = _RESOLVER.resolve([dr.DataUrlImageSource(data_url(out.getvalue(), "image/jpeg"))],
                                dr.ImageQuota()).images
    assert (info.width, info.height) == release_layout(600, 300)[:2] == (770, 392)


def test_low_detail_shrinks_the_image_first():
    """A request's `detail: "low"` (which the recipe's conversion keeps) shrinks the long side to 512 pixels
    before the release's rule: fewer tokens than the release gives the image."""
    image = png(Image.new("L", (1200, 800), 90))
    request = dr.ChatCompletionRequest({"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}}]}]})
    (source,) = request.convert(dr.ConversionOptions()).conversation.messages[0].image_sources
    assert source.detail == "low"
    high, low = resolve(image), resolve(image, detail="low")
    assert (high.images[0].width, high.images[0].height) == release_layout(1200, 800)[:2] == (1204, 812)
    assert high.image_token_adjustment() + 1 == release_layout(1200, 800).tokens == 602
    shrunk = (RECIPE_LOW_DETAIL_SIDE, round(800 * RECIPE_LOW_DETAIL_SIDE / 1200))  # 512×341
    assert (low.images[0].width, low.images[0].height) == release_layout(*shrunk)[:2] == (672, 448)
    assert low.image_token_adjustment() + 1 == 189


def test_sides_over_the_recipes_limits_are_refused():
    """The release takes any size; the recipe refuses sides over 8,192 pixels, and over 4,096 once a request
    has 15 images."""
    with pytest.raises(dr.ImageError) as e:
        resolve(png(Image.new("L", (RECIPE_MAX_SIDE + 1, 1), 90)))
    assert e.value.kind == "ImageDimensionsTooLarge"
    resolve(png(Image.new("L", (RECIPE_MAX_SIDE, 1), 90)))
    wide, small = png(Image.new("L", (RECIPE_MAX_SIDE_MANY + 1, 10), 90)), png(Image.new("L", (10, 10), 90))
    assert len(resolve(wide, *[small] * (RECIPE_MANY_IMAGES - 2)).images) == RECIPE_MANY_IMAGES - 1
    with pytest.raises(dr.ImageError) as e:
        resolve(wide, *[small] * (RECIPE_MANY_IMAGES - 1))
    assert e.value.kind == "ImageDimensionsTooLarge"


# ---------------------------------------------------------------------------------------------------------
# Pixels


def test_webp_loss_alone():
    """An image already at a canvas size is only re-encoded: the loss of the recipe's WebP alone on smooth
    content, the baseline of the pixel bounds below (measured: max 8, mean 0.94)."""
    src = smooth_content(644, 490, 3)
    assert release_layout(644, 490)[:2] == (644, 490)
    (info,) = resolve(png(src)).images
    assert info.data[8:16] == b"WEBPVP8 "  # lossy: a lossless WebP holds a "VP8L" chunk
    diff = np.abs(decode(info).astype(int) - src)
    print(f"\nWebP alone: max {diff.max()}, mean {diff.mean():.3f}")
    assert 0 < diff.max() <= 12 and diff.mean() <= 1.5


def _edges(canvas: np.ndarray, box: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    """The content's (left, top, right, bottom) edges in `canvas`, to a fraction of a pixel: from the
    deviation from the pad gray summed across the edge, divided by the deviation just inside (so an edge
    blurred symmetrically, as WebP blurs it, is found where it is)."""
    dev = np.abs(canvas.astype(float)[..., :2] - PAD_GRAY).mean(-1)  # R, G: far from the gray inside
    left, top, w, h = box
    found = []
    for profile, start, length in ((dev.mean(0), left, w), (dev.mean(1), top, h)):
        k = start + 3
        level = profile[k:k + 3].mean()
        first = k - profile[:k].sum() / level
        k = start + length - 3
        level = profile[k - 3:k].mean()
        last = k + profile[k:].sum() / level
        found.append((first, last))
    (x0, x1), (y0, y1) = found
    return x0, y0, x1, y1


def _normalize_patchify(canvas: np.ndarray) -> np.ndarray:
    """The release's model input from a uint8 canvas: bf16((x/255 − 0.5)/0.5), 14×14 patches in row-major
    order, each (channel, y, x)."""
    x = ((canvas.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    h, w = canvas.shape[0] // PATCH, canvas.shape[1] // PATCH
    return x.reshape(h, PATCH, w, PATCH, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, PATCH, PATCH)


@pytest.mark.parametrize("index", range(len(CANVAS_SIZES)))
def test_canvas_against_nemos(index, nemo, canvas_images):
    """The recipe's canvas against NeMo's (PIL's ImageOps.pad, lossless) for smooth content: same size,
    content placed the same (to within half a pixel), pad gray 127, and pixels as close as WebP's loss
    allows. Bounds: inside the content (3 pixels in from its edges) max 12 and mean 1.5 levels, 1.5× what
    WebP alone gives (test_webp_loss_alone): both resamplers are bicubic, and on smooth content their
    difference is small beside WebP's. Within 2 pixels of the content's edges WebP's 4:2:0 chroma and block
    transform blur the sharp edge against the gray (measured up to 68 levels); the pad further out stays
    within 10 of 127 (measured 7), and exactly 127 where the pad is wide (measured on long strips)."""
    w, h = CANVAS_SIZES[index]
    (info,) = resolve(canvas_images[index]).images
    ours, theirs = decode(info).astype(int), nemo[f"canvas_{index}"].astype(int)
    layout = release_layout(w, h)
    assert ours.shape == theirs.shape == (layout.height, layout.width, 3)
    # NeMo's patches are the release's normalisation of its canvas (which this test's bounds are about).
    np.testing.assert_array_equal(nemo[f"patches_{index}"], _normalize_patchify(theirs.astype(np.uint8)))

    box = content_box(w, h, layout.width, layout.height)
    left, top, bw, bh = box
    yy, xx = np.mgrid[0:layout.height, 0:layout.width]
    # how far outside the content box a pixel is (negative: inside)
    outside = np.maximum(np.maximum(top - yy, yy - (top + bh - 1)), np.maximum(left - xx, xx - (left + bw - 1)))
    assert (theirs[outside > 0] == PAD_GRAY).all() and (theirs[outside <= 0, :2] != PAD_GRAY).any(-1).all()
    expected = (left, top, left + bw, top + bh)
    assert np.allclose(_edges(theirs, box), expected, atol=0.25)  # the estimate's own error: content varies
    edges = _edges(ours, box)
    assert np.allclose(edges, expected, atol=0.5), (edges, expected)

    diff = np.abs(ours - theirs)
    inner, far_pad = diff[outside <= -3], np.abs(ours[outside >= 3] - PAD_GRAY)
    print(f"\n{w}x{h} -> {layout.width}x{layout.height}, content {bw}x{bh} at ({left}, {top}): |recipe - NeMo| "
          f"max {diff.max()}, mean {diff.mean():.3f}, p99 {np.percentile(diff, 99):.0f}; inside max "
          f"{inner.max()}, mean {inner.mean():.3f}; pad 3+ px out: max |x - 127| "
          f"{far_pad.max() if far_pad.size else '-'}; edges {np.round(edges, 2)} (expected {expected})")
    assert inner.max() <= 12 and inner.mean() <= 1.5
    assert diff.mean() <= 3
    assert far_pad.size == 0 or far_pad.max() <= 10


def test_wide_pads_are_gray_127():
    """Where the pad is wide, it decodes to exactly 127: 1×8192 → a 42×16380 canvas with the content in
    columns 20-21; WebP codes 16×16 blocks (columns 16-31 hold the content) and filters across their edges,
    so columns 12-15 and 32-33 may be off by a level or two."""
    (info,) = resolve(png(Image.new("RGB", (1, 8192), (20, 230, 20)))).images
    canvas = decode(info)
    assert canvas.shape == (16380, 42, 3) and content_box(1, 8192, 42, 16380) == (20, 0, 2, 16380)
    assert (canvas[:, :12] == PAD_GRAY).all() and (canvas[:, 34:] == PAD_GRAY).all()
    assert (np.abs(canvas[:, 20:22, 1].astype(int) - 230) < 40).all()  # the content: green


def test_transparency_is_blended_onto_fdfdfd_where_pil_drops_it(nemo):
    """The recipe blends transparent pixels onto #FDFDFD; the release's processors (PIL's convert("RGB"))
    keep the colour a transparent pixel holds, here black."""
    index = len(CANVAS_SIZES)
    (info,) = resolve(png(_transparent_image())).images
    ours, theirs = decode(info).astype(int), nemo[f"canvas_{index}"].astype(int)
    layout = release_layout(400, 300)
    assert ours.shape == theirs.shape == (layout.height, layout.width, 3)
    left, top, w, h = content_box(400, 300, layout.width, layout.height)
    right = (slice(top + 10, top + h - 10), slice(left + w // 2 + 10, left + w - 10))  # transparent
    assert (np.abs(ours[right] - 253) <= 3).all()
    assert (theirs[right] == 0).all()


def test_downscaling_is_not_antialiased(nemo):
    """The recipe downscales with OpenCV's INTER_CUBIC, which does not antialias; the release's processors
    use PIL's BICUBIC, which does. 1-pixel black and white stripes shrunk 3000 → 1568 come out flat gray
    from PIL (std ≈ 1) and as strong moiré from the recipe (std ≈ 89)."""
    index = len(CANVAS_SIZES) + 1
    (info,) = resolve(png(_stripes())).images
    ours, theirs = decode(info).astype(float), nemo[f"canvas_{index}"].astype(float)
    assert ours.shape == theirs.shape == (1050, 1568, 3)
    ours, theirs = ours[5:-5], theirs[5:-5]  # the content, without the pad rows
    print(f"\nstripes: std recipe {ours.std():.1f}, PIL {theirs.std():.1f}; mean |diff| "
          f"{np.abs(ours - theirs).mean():.1f}")
    assert theirs.std() < 5 and ours.std() > 40
