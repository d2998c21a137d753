#!/usr/bin/env bash
# Install everything and run the main demo on a local Kubernetes control plane:
#
#   scripts/demo.sh            set up (venv + Go tools, cached), bring up the control plane,
#                              helm install the operator, apply a CheckpointPolicy, run an
#                              annotated PyTorchJob, SIGKILL it, watch the automatic resume,
#                              print a summary, tear everything down
#   scripts/demo.sh --keep     ... and leave the cluster and the operator running
#   scripts/demo.sh --steps N  train N steps (default 150)
#
# Output (report, `ckpt report` HTML+JSON of the run and --all, events, logs, every pod's
# output) goes to demo-output/<time>/ (latest: the newest). No Docker, S3 or GPU needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

case "${1:-}" in
  -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
esac

scripts/setup.sh --tools
export PYTHONPATH="$PWD/e2e${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m ckpt_e2e.demo "$@"
