"""lca_jax: hierarchical byte-level language models with dynamic multi-byte prediction.

    import lca_jax
    model = lca_jax.load("path/to/checkpoint")   # upstream PyTorch layout or an lca-train workdir
    out = model.forward(ids)                      # ntp_logits, mbp_logits, boundaries
    res = model.generate("Once upon", mode="threshold", tau=0.9, n=3)

Heavy modules (jax, flax) are imported on first use, so ``lca_jax.data`` and ``lca_jax.vocab``
stay light (grain worker processes import them).
"""

from lca_jax.errors import LoadError
from lca_jax.model.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["load", "Model", "LoadError", "DecodeError", "ModelConfig"]


# Lazy (PEP 562): every import of lca_jax.vocab / lca_jax.data (grain worker processes too) runs
# this file; importing api or decode here would load jax, flax and the model into each of them.
def __getattr__(name):
  if name in ("load", "Model"):
    from lca_jax import api  # pylint: disable=g-import-not-at-top

    return getattr(api, name)
  if name == "DecodeError":
    from lca_jax.decode.engine import DecodeError  # pylint: disable=g-import-not-at-top

    return DecodeError
  raise AttributeError(f"module 'lca_jax' has no attribute {name!r}")
