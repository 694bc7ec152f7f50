"""Pretraining: sharded train state, jitted step, checkpoints, metrics and the loop.

    from lca_jax.train.loop import train_and_evaluate
    result = train_and_evaluate(config, "workdirs/run")   # resumes if the workdir has a checkpoint

Modules: sharding (mesh, logical rules), optim (Adam + warmup/cosine), state (TrainState,
sharded init), step (train/eval steps), checkpoint (orbax saves and restores of train states),
save_failures (failed saves, reported once), data_state (the data iterator's state in a
checkpoint), distributed (joining / leaving a multi-process run), collectives (agreement and
abortable barriers among processes), watchdog (ends a stuck process), run_config (the
run's config fields, resume checks, validation; ``workdir.config_file`` writes
train_config.json), metrics (jsonl/TensorBoard/MFU), inputs (batch plan, data sources and pipelines of a config), stop
(SIGTERM / request_stop), errors (TrainError), hooks (the per-step hooks of the loop: late
metric fetch, finite check, metrics window, console, eval, checkpoints, watchdog), loop
(train_and_evaluate). ``lca_jax.load`` imports none of them: it reads work directories through
``lca_jax.workdir``.
"""
