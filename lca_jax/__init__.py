"""lca_jax: hierarchical byte-level language models with dynamic multi-byte prediction."""
