"""dsjax: DeepSeek-V4 offline batch inference in JAX / Flax NNX."""

from dsjax.checkpoint.load import load_model
from dsjax.checkpoint.save import save_model
from dsjax.compile_cache import enable_compile_cache
from dsjax.config import ModelConfig, QuantConfig
from dsjax.engine.engine import Engine
from dsjax.engine.generate import GenerationResult, generate
from dsjax.engine.sampling import SamplingParams
from dsjax.model import DeepseekV4
from dsjax.quantize import dequantize_model, quantize_model
from dsjax.run_config import RunConfig

__all__ = ["DeepseekV4", "Engine", "GenerationResult", "ModelConfig", "QuantConfig", "RunConfig", "SamplingParams",
           "dequantize_model", "enable_compile_cache", "generate", "load_model", "quantize_model", "save_model"]
