"""hybridmoe: ultra-sparse MoE language models with hybrid KDA/MLA attention, in JAX/Flax.

Public entry points: `load_config(gin_files, bindings)` and `build_model(model_config)`.
"""

from hybridmoe.config import ExperimentConfig, load_config
from hybridmoe.model import HybridLM, build_model

__all__ = ["ExperimentConfig", "HybridLM", "build_model", "load_config"]
