"""What `dsjax convert` needs to know of a model family, DeepSeek-V4 or DeepSeek-V4.1: how its config reads,
where each tensor goes, how one tensor is checked and placed, what a complete checkpoint holds, and the
names an array of the converted layout goes back to. Everything else of the conversion (header checks,
streaming, journal, verification, manifest) is the same for both."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dsjax.checkpoint.load import check_complete, place
from dsjax.checkpoint.load_v41 import check_complete_v41, place_v41
from dsjax.checkpoint.save import hf_value, original_names
from dsjax.checkpoint.save_v41 import release_names
from dsjax.checkpoint.targets import Target, abstract_model, abstract_model_v41
from dsjax.config import ModelConfig
from dsjax.config_v41 import V41Config, is_v41


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[dict], Any]  # parsed config.json → the family's config (raises naming a bad field)
    targets: Callable[[Any], dict[str, Target]]  # config → layout key → Target, storage as the config says
    # (stored, cfg, name, file, value, scale, targets, dest, filled): check one source tensor and write it
    # through dest(target, source_dtype); see `load.place`.
    place: Callable[..., None]
    check_complete: Callable[[str, Any, dict, set], None]  # (folder, cfg, targets, filled): name what lacks
    # (cfg, key, array, first expert of a block) → (original name, array): `--to-hf`.
    originals: Callable[[Any, str, np.ndarray, int], Iterator[tuple[str, np.ndarray]]]


def _v4_originals(cfg: ModelConfig, hf: str, value: np.ndarray, first_expert: int):
    return original_names(cfg, [(hf, hf_value(hf, value, cfg.quantization is None))], first_expert=first_expert)


# Each plan traces the model's constructor for its targets (seconds for the release's configs, and twice for
# weights="bf16"); a re-run, a resume or another conversion of the same config reuses them. Nothing changes them.
@functools.lru_cache(maxsize=4)
def _v4_targets(cfg: ModelConfig) -> dict[str, Target]:
    return abstract_model(cfg)[2]


@functools.lru_cache(maxsize=4)
def _v41_targets(cfg: V41Config) -> dict[str, Target]:
    return abstract_model_v41(cfg)[2]


V4 = Family("DeepSeek-V4", ModelConfig.from_hf, _v4_targets, place, check_complete, _v4_originals)
V41 = Family("DeepSeek-V4.1", V41Config.from_hf, _v41_targets, place_v41, check_complete_v41, release_names)


def family_of(raw: dict) -> Family:
    """The family of a parsed `config.json`."""
    return V41 if isinstance(raw, dict) and is_v41(raw) else V4
