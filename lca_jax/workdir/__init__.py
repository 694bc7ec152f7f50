"""lca-train work directories without the training stack: what ``lca_jax.load``,
``train.init_from`` and an import of a checkpoint (``lca-convert from-torch``) need.

Layout of WORKDIR:
  train_config.json      {"model": ModelConfig fields, "config": the full run config}
  checkpoints/<step>/    orbax Composite items
      params, opt_state               StandardSave (sharded arrays; restorable onto any mesh)
      step, rng                       StandardSave of {"step": int32} and {"key": uint32[2]}
      data                            the grain iterator state (grain.checkpoint handler)
      meta                            JSON: model config, step, bytes seen
      lca_manifest.json               every file of the committed step and its size

Modules: config_file (reading and writing train_config.json), manifest (integrity of committed
steps), params (restoring only the params of a step, for inference), write (a fresh work
directory holding given params as step 0). Nothing here imports ``lca_jax.train``: loading and
decoding a model never import the training stack, which writes the train states of these
directories (``lca_jax.train.checkpoint``).
"""
