#!/usr/bin/env bash
# Run lca-train as a multi-process (multi-host) job on jax.distributed.
#
# One process of an N-process run (start one per host / per GPU group, same arguments except
# --process-id; process 0 hosts the coordinator, so HOST:PORT must be process 0's host):
#
#   launch/multiprocess.sh --coordinator HOST:PORT --num-processes N --process-id I \
#       [--local-device-ids 0,1,2,3] -- <lca-train args>
#
# N processes on this host (the coordinator on 127.0.0.1, a free port unless --port; each
# process gets K devices when --devices-per-process K is given, else the local GPUs split
# evenly, else what jax finds, e.g. the CPU):
#
#   launch/multiprocess.sh --local N [--devices-per-process K] [--port P] -- <lca-train args>
#
# One task of a SLURM step (what launch/slurm.sbatch runs under srun; coordinator = first host
# of SLURM_JOB_NODELIST, process count / id = SLURM_NTASKS / SLURM_PROCID, local devices from
# CUDA_VISIBLE_DEVICES / SLURM_LOCALID):
#
#   launch/multiprocess.sh --slurm -- <lca-train args>
#
# Every mode ends in `lca-train --coordinator ... --num-processes ... --process-id ...
# [--local-device-ids ...] <lca-train args>`, i.e. jax.distributed.initialize(coordinator_address,
# num_processes, process_id, local_device_ids=...) and then the same training on every process.
#
# Options (any mode): --heartbeat-timeout S (a dead process makes the others exit after S
# seconds; default 60), --init-timeout S (wait for all processes to connect; default 300),
# --dry-run (print the environment and command instead of running them).
# Environment: LCA_TRAIN = the command to run (default: lca-train if on PATH, else
# "${PYTHON:-python3} -m lca_jax.cli.train").
#
# Local mode: SIGTERM / SIGINT to this script is forwarded to every process (they checkpoint
# at the same step and exit 0). When one process fails, the script waits up to
# LCA_FAIL_GRACE seconds (default heartbeat timeout + 30) for the others to stop by themselves
# (jax's heartbeat makes them exit), then kills what is left; its exit status is the first
# non-zero status of a process (0 when all succeeded).
set -euo pipefail

usage() { sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "multiprocess.sh: error: $*" >&2; exit 2; }

mode="" coordinator="" num_processes="" process_id="" local_ids="" local_n="" per_proc=""
port="" heartbeat="" init_timeout="" dry_run=0
while (($#)); do
  case "$1" in
    --coordinator) coordinator="${2:?}"; mode="${mode:-explicit}"; shift 2 ;;
    --num-processes) num_processes="${2:?}"; shift 2 ;;
    --process-id) process_id="${2:?}"; shift 2 ;;
    --local-device-ids) local_ids="${2:?}"; shift 2 ;;
    --local) local_n="${2:?}"; mode="local"; shift 2 ;;
    --devices-per-process) per_proc="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --slurm) mode="slurm"; shift ;;
    --heartbeat-timeout) heartbeat="${2:?}"; shift 2 ;;
    --init-timeout) init_timeout="${2:?}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (lca-train arguments go after --)" ;;
  esac
done
[[ -n "$mode" ]] || usage 2
train_args=("$@")

source "$(dirname "${BASH_SOURCE[0]}")/train_cmd.sh"
train_cmd=("${LCA_TRAIN_CMD[@]}")

common=()
[[ -n "$heartbeat" ]] && common+=(--heartbeat-timeout "$heartbeat")
[[ -n "$init_timeout" ]] && common+=(--init-timeout "$init_timeout")

run_one() {  # coordinator n id local_ids: exec one process
  local cmd=("${train_cmd[@]}" --coordinator "$1" --num-processes "$2" --process-id "$3")
  [[ -n "$4" ]] && cmd+=(--local-device-ids "$4")
  cmd+=("${common[@]}" "${train_args[@]}")
  if ((dry_run)); then
    echo "JAX_COORDINATOR_ADDRESS=$1 JAX_NUM_PROCESSES=$2 JAX_PROCESS_ID=$3 JAX_LOCAL_DEVICE_IDS=$4"
    printf '%q ' "${cmd[@]}"; echo
    return 0
  fi
  export JAX_COORDINATOR_ADDRESS="$1" JAX_NUM_PROCESSES="$2" JAX_PROCESS_ID="$3"
  if [[ -n "$4" ]]; then export JAX_LOCAL_DEVICE_IDS="$4"; else unset JAX_LOCAL_DEVICE_IDS; fi
  exec "${cmd[@]}"
}

id_range() { seq -s, "$1" "$(($1 + $2 - 1))"; }  # first count -> "first,...,first+count-1"

case "$mode" in
  explicit)
    [[ -n "$num_processes" && -n "$process_id" ]] || die "--coordinator needs --num-processes and --process-id"
    [[ "$coordinator" == *:* ]] || die "--coordinator must be HOST:PORT, got $coordinator"
    run_one "$coordinator" "$num_processes" "$process_id" "$local_ids"
    ;;

  slurm)
    : "${SLURM_NTASKS:?--slurm: not inside a SLURM step (SLURM_NTASKS unset)}"
    : "${SLURM_PROCID:?--slurm: SLURM_PROCID unset}"
    coord="${JAX_COORDINATOR_ADDRESS:-}"
    if [[ -z "$coord" ]]; then
      nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?SLURM_JOB_NODELIST unset}}"
      if command -v scontrol > /dev/null 2>&1; then
        host="$(scontrol show hostnames "$nodelist" | head -n 1)"
      else  # lca_jax's parser of SLURM node lists
        host="$("${PYTHON:-python3}" -c 'import sys; from lca_jax.train.distributed import parse_nodelist; print(parse_nodelist(sys.argv[1])[0])' "$nodelist")"
      fi
      coord="$host:${LCA_COORDINATOR_PORT:-$((${SLURM_JOB_ID:-0} % 4096 + 61440))}"
    fi
    # Local devices: one task per node -> all its GPUs; several tasks per node -> the GPUs
    # SLURM bound to this task (CUDA_VISIBLE_DEVICES shorter than the task count), else this
    # task's equal share of the visible GPUs by SLURM_LOCALID, else GPU SLURM_LOCALID.
    ids="$local_ids"
    tasks_here="${SLURM_NTASKS_PER_NODE:-}"
    if [[ -z "$tasks_here" && -n "${SLURM_TASKS_PER_NODE:-}" ]]; then
      tasks_here="${SLURM_TASKS_PER_NODE%%[(,]*}"
    fi
    if [[ -z "$ids" && "${tasks_here:-1}" -gt 1 && -n "${SLURM_LOCALID:-}" ]]; then
      IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
      if ((${#visible[@]} == 0)); then
        ids="$SLURM_LOCALID"
      elif ((${#visible[@]} >= tasks_here)); then
        per=$((${#visible[@]} / tasks_here))
        ids="$(id_range $((SLURM_LOCALID * per)) "$per")"
      fi
    fi
    run_one "$coord" "$SLURM_NTASKS" "$SLURM_PROCID" "$ids"
    ;;

  local)
    [[ "$local_n" =~ ^[1-9][0-9]*$ ]] || die "--local needs a process count, got $local_n"
    if [[ -z "$port" ]]; then
      port="$("${PYTHON:-python3}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    if [[ -z "$per_proc" ]] && command -v nvidia-smi > /dev/null 2>&1; then
      ngpu="$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)"
      if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"; ngpu=${#visible[@]}
      fi
      if ((ngpu >= local_n && ngpu % local_n == 0)); then per_proc=$((ngpu / local_n)); fi
    fi
    pids=()
    forward() {
      echo "multiprocess.sh: $1: forwarding SIGTERM to ${#pids[@]} processes" >&2
      for p in "${pids[@]}"; do kill -TERM "$p" 2> /dev/null || true; done
    }
    trap 'forward SIGTERM' TERM
    trap 'forward SIGINT' INT
    for ((i = 0; i < local_n; i++)); do
      ids=""
      [[ -n "$per_proc" ]] && ids="$(id_range $((i * per_proc)) "$per_proc")"
      if ((dry_run)); then
        (run_one "127.0.0.1:$port" "$local_n" "$i" "$ids")
      else
        (run_one "127.0.0.1:$port" "$local_n" "$i" "$ids") > >(sed -u "s/^/[$i] /") 2>&1 &
        pids+=($!)
      fi
    done
    ((dry_run)) && exit 0
    status=0 first_fail_at="" grace="${LCA_FAIL_GRACE:-$((${heartbeat:-60} + 30))}"
    declare -A done_=()
    while ((${#done_[@]} < ${#pids[@]})); do
      for i in "${!pids[@]}"; do
        [[ -n "${done_[$i]:-}" ]] && continue
        if ! kill -0 "${pids[$i]}" 2> /dev/null; then
          rc=0; wait "${pids[$i]}" || rc=$?
          done_[$i]=1
          if ((rc != 0)); then
            echo "multiprocess.sh: process $i exited with status $rc" >&2
            if ((status == 0)); then status=$rc; first_fail_at=$SECONDS; fi
          fi
        fi
      done
      if [[ -n "$first_fail_at" ]] && ((SECONDS - first_fail_at > grace)); then
        for i in "${!pids[@]}"; do
          if [[ -z "${done_[$i]:-}" ]]; then
            echo "multiprocess.sh: process $i still running ${grace}s after a failure: killing it" >&2
            kill -KILL "${pids[$i]}" 2> /dev/null || true
          fi
        done
        first_fail_at=""
      fi
      sleep 0.5 & wait $! || true
    done
    exit "$status"
    ;;
esac
