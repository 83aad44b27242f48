#!/usr/bin/env bash
# llama3.1-8b-8xh100-sxm-80gb: start train.py under torchrun, 8 processes per node on 1 node.
#
# One node: ./launch.sh --steps 100 (torchrun picks a free local port).
# Several nodes: run this script on every node with the same RDZV_ENDPOINT, host:port of a node
# all of them reach (or MASTER_ADDR and MASTER_PORT), and the same RDZV_ID:
#   RDZV_ENDPOINT=node0:29500 RDZV_ID=run1 ./launch.sh --steps 100
# NNODES and NPROC_PER_NODE override the plan's shape. Arguments go on to train.py
# (python train.py --help lists them).
#
# When a rank dies, torchrun restarts all of them (MAX_RESTARTS times, default 3) and they
# resume from the newest checkpoint whose files match its manifest; use --checkpoint-every N
# so a restart repeats at most N steps. MAX_RESTARTS=0 ends the job at the first failure.
# A run that stops on purpose is not restarted; its exit status says why: 3 a NaN/inf loss or
# gradient norm (train.py --skip-bad-steps N skips up to N such steps), 4 a checkpoint that could
# not be written (full disk), 143 preempted by SIGTERM/SIGUSR1 after saving a checkpoint
# (run again with --resume).
set -euo pipefail

JOB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
RDZV_ID="${RDZV_ID:-llama3.1-8b-8xh100-sxm-80gb}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
# fewer fragmentation OOMs near the memory limit (as torchtitan's run_train.sh)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# NCCL says why a collective failed
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

if [[ -n "${RDZV_ENDPOINT:-}" || -n "${MASTER_ADDR:-}" ]]; then
  RDZV_ENDPOINT="${RDZV_ENDPOINT:-${MASTER_ADDR}:${MASTER_PORT:-29500}}"
  rendezvous=(--rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT}" --rdzv-id "${RDZV_ID}")
  export AUTOPLAN_RUN_ID="${RDZV_ID}"  # the run directory lock of this job's rank 0 is not another job's
elif [[ "${NNODES}" == 1 ]]; then
  rendezvous=(--standalone)
else
  echo "launch.sh: ${NNODES} nodes need a rendezvous: set RDZV_ENDPOINT=host:port (a node every" \
       "node reaches, the same on all of them) and run this script on each node" >&2
  exit 2
fi

# Where train.py writes metrics.jsonl and, when it stops on purpose, exit.json (see below).
run_dir="./runs/latest"
args=("$@")
for ((i = 0; i < $#; i++)); do
  case "${args[i]}" in
    --run-dir) run_dir="${args[i + 1]:-${run_dir}}" ;;
    --run-dir=*) run_dir="${args[i]#--run-dir=}" ;;
  esac
done

# One process checks the plan, --data, the run directory's lock and (with --resume) the
# checkpoints before any rank starts: bad input ends here with one message and exit status 2.
"${PYTHON:-python3}" "${JOB_DIR}/train.py" --check-only "$@"
rm -f "${run_dir}/exit.json"

# SIGTERM (what SLURM and Kubernetes send before a kill) or SIGUSR1 to this script: torchrun
# passes it to the ranks, which save a checkpoint at the next step boundary and stop; torchrun
# waits SHUTDOWN_TIMEOUT seconds (default 120) for that before it kills them. torchrun runs in
# a session of its own so that it gets each signal once, from here, whether the signal was
# sent to this script or to its whole process group.
setsid torchrun --nnodes "${NNODES}" --nproc-per-node "${NPROC_PER_NODE}" "${rendezvous[@]}" \
  --max-restarts "${MAX_RESTARTS}" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" "${JOB_DIR}/train.py" "$@" &
torchrun_pid=$!
for signal in TERM INT HUP QUIT USR1; do
  # shellcheck disable=SC2064  # the signal's name is fixed when the trap is set
  trap "kill -s ${signal} ${torchrun_pid} 2>/dev/null || true" "${signal}"
done
status=0
while true; do
  wait "${torchrun_pid}" && status=0 || status=$?
  kill -0 "${torchrun_pid}" 2>/dev/null || break  # a trapped signal interrupted the wait
done

# torchrun reports 1 whatever stopped the ranks; exit.json holds their status: 3 a NaN/inf
# loss, 4 a checkpoint that could not be written (full disk), 143 preempted: a checkpoint was
# saved, run again with --resume (launchers that requeue on 128-255 do so).
if [[ -f "${run_dir}/exit.json" ]]; then
  status="$("${PYTHON:-python3}" -c 'import json, sys; print(json.load(open(sys.argv[1]))["status"])' \
    "${run_dir}/exit.json")"
fi
exit "${status}"
