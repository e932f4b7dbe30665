#!/usr/bin/env bash
# Two torchrun "nodes" on this machine sharing one checkpoint directory, running scripts/train_demo.py.
#
# On a real cluster each node runs the same torchrun command (see README "Running on a Trn1 cluster");
# here both agents run on 127.0.0.1 and meet through a c10d rendezvous, so ranks see node-local
# LOCAL_RANK / LOCAL_WORLD_SIZE exactly as on two hosts.
#
# usage: scripts/launch_multinode.sh [--steps N] [--ckpt-dir DIR] [--nproc-per-node P] [--nnodes N]
#                                    [--port PORT] [--out FILE] [-- more train_demo.py args]
#   --steps N           train until global step N (default 12); a second launch resumes from the newest
#                       complete checkpoint in DIR and continues to N
#   --ckpt-dir DIR      the shared checkpoint directory (default /tmp/nxd_ckpt_multinode)
#   --nproc-per-node P  ranks per node (default 2; 2 nodes x 2 = TP=2 x DP=2)
#   --port PORT         rendezvous port (default: a free one)
#   --out FILE          train_demo.py's JSON report (rank 0)
# Everything after `--` goes to train_demo.py (e.g. -- --zero1 --ckpt-every 4 --crash-at-step 8).
# Exit status: the first non-zero torchrun exit status, else 0.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi

STEPS=12
CKPT_DIR=/tmp/nxd_ckpt_multinode
NPROC=2
NNODES=2
PORT=""
OUT=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --ckpt-dir) CKPT_DIR="$2"; shift 2 ;;
    --nproc-per-node) NPROC="$2"; shift 2 ;;
    --nnodes) NNODES="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "launch_multinode.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$PORT" ]]; then
  PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

if [[ -z "${PJRT_DEVICE:-}" ]]; then   # Neuron devices when the host has them, else the XLA CPU device
  if [[ -e /dev/neuron0 ]]; then PJRT_DEVICE=NEURON; else PJRT_DEVICE=CPU; fi
fi
export PJRT_DEVICE
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$CKPT_DIR"

ARGS=(--steps "$STEPS" --ckpt-dir "$CKPT_DIR")
[[ -n "$OUT" ]] && ARGS+=(--out "$OUT")
ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})
RDZV_ID="nxd-ckpt-demo-$$"

echo "launch_multinode: $NNODES nodes x $NPROC ranks, rendezvous c10d 127.0.0.1:$PORT, checkpoints in $CKPT_DIR"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap 'cleanup; wait; exit 130' INT TERM
for ((node = 0; node < NNODES; node++)); do
  # One torchrun agent per node; on a cluster: the same line on each host with the head node's address.
  "$PY" -m torch.distributed.run \
      --nnodes "$NNODES" --node-rank "$node" --nproc-per-node "$NPROC" \
      --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "$RDZV_ID" --max-restarts 0 \
      "$HERE/train_demo.py" "${ARGS[@]}" \
      > >(sed -u "s/^/[node$node] /") 2>&1 < /dev/null &
  PIDS+=($!)
done

RC=0
for pid in "${PIDS[@]}"; do
  if wait "$pid"; then :; else
    code=$?
    [[ $RC -eq 0 ]] && RC=$code
  fi
done
wait   # the output prefixers
echo "launch_multinode: exit $RC"
exit "$RC"
