"""lca_jax: hierarchical byte-level language models with dynamic multi-byte prediction.

    import lca_jax
    model = lca_jax.load("path/to/checkpoint")   # upstream PyTorch layout or an lca-train workdir
    out = model.forward(ids)                      # ntp_logits, mbp_logits, boundaries
"""
from lca_jax.api import LoadError, Model, load
from lca_jax.model.config import ModelConfig

__all__ = ["load", "Model", "LoadError", "ModelConfig"]
__version__ = "0.1.0"
