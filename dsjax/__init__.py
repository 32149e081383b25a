"""dsjax: DeepSeek-V4 offline batch inference in JAX / Flax NNX."""

from dsjax.checkpoint.load import load_model
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4

__all__ = ["DeepseekV4", "ModelConfig", "load_model"]
