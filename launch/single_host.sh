#!/usr/bin/env bash
# lca-train as a single process using every accelerator of this host (no jax.distributed):
#
#   launch/single_host.sh --config configs/lca_mbp.py --workdir workdirs/run1 [--config.x=y ...]
#   GPUS=0,1,2,3 launch/single_host.sh ...      # only these GPUs
#
# One process drives all local devices (the mesh spans them); SIGTERM / Ctrl-C checkpoint and
# exit (rerun the same command to resume). Variables that would make lca-train join a
# multi-process run (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, SLURM_NTASKS)
# are cleared. LCA_TRAIN overrides the command (default lca-train, else python -m).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/train_cmd.sh"
cmd=("${LCA_TRAIN_CMD[@]}")
[[ -n "${GPUS:-}" ]] && export CUDA_VISIBLE_DEVICES="$GPUS"
unset JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID JAX_LOCAL_DEVICE_IDS
export SLURM_NTASKS=1
exec "${cmd[@]}" "$@"
