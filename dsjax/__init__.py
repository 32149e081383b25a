"""dsjax: DeepSeek-V4 offline batch inference in JAX / Flax NNX."""

from dsjax.checkpoint.load import load_model
from dsjax.config import ModelConfig
from dsjax.engine.generate import GenerationResult, generate
from dsjax.engine.sampling import SamplingParams
from dsjax.model import DeepseekV4

__all__ = ["DeepseekV4", "GenerationResult", "ModelConfig", "SamplingParams", "generate", "load_model"]
