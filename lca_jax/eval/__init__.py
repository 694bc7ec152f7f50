"""Evaluation: bits per byte (``bpb``), task metrics (``metrics``, ``ifeval``), generative tasks
(``tasks``), quality/throughput sweeps (``sweep``) and their plots (``plots``).

Command line: ``lca-eval bpb|tasks|sweep`` (:mod:`lca_jax.cli.eval`).  Submodules are imported
on use (``from lca_jax.eval import tasks``), so importing this package stays light.
"""
