#!/usr/bin/env bash
# Install what the demo needs and run it on a local Kubernetes control plane:
#
#   scripts/demo.sh            set up (venv + the Go tools the demo uses, cached), bring up
#                              the control plane, helm install the operator, apply a
#                              CheckpointPolicy, run an annotated PyTorchJob, SIGKILL it,
#                              watch the automatic resume, print a summary, tear down
#   scripts/demo.sh --keep     ... and leave the cluster and the operator running
#   scripts/demo.sh --steps N  train N steps (default 150)
#   scripts/demo.sh --local    no cluster, no Go tools: train the example locally, SIGKILL
#                              it, resume bit-exact, `ckpt report` (a couple of minutes
#                              after the Python install; --steps, --kill-after, --output)
#
# The demo builds only the Go tools it uses (kubernetes, etcd, kwok, helm,
# training-operator: e2e/build-tools.sh prints an estimate before a cold build and its
# progress during it); scripts/test.sh builds the rest. Output (report, `ckpt report` HTML+JSON
# of the run and --all, events, logs, every pod's output) goes to demo-output/<time>/
# (latest: the newest; --local: <time>-local, latest-local). No Docker, S3 or GPU needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What python -m ckpt_e2e.demo starts: LocalCluster (kube-apiserver, controller-manager,
# scheduler, kubectl from kubernetes; etcd; kwok; the training-operator and its CRD) and
# helm (tests/test_examples.py checks this list against the harness).
DEMO_TOOLS=(kubernetes etcd kwok helm training-operator)

case "${1:-}" in
  -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --local)
    shift
    scripts/setup.sh
    export PYTHONPATH="$PWD/e2e${PYTHONPATH:+:$PYTHONPATH}"
    exec .venv/bin/python -m ckpt_e2e.quickstart "$@"
    ;;
esac

scripts/setup.sh
if ! e2e/build-tools.sh --estimate "${DEMO_TOOLS[@]}" 2>&1 | grep -q "nothing to build"; then
  printf '\033[1;34m[demo]\033[0m first run: building the Go tools the demo uses (cached for later runs);\n' >&2
  printf '\033[1;34m[demo]\033[0m meanwhile, in another shell, scripts/demo.sh --local shows the agent without a cluster\n' >&2
fi
e2e/build-tools.sh "${DEMO_TOOLS[@]}"
export PYTHONPATH="$PWD/e2e${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m ckpt_e2e.demo "$@"
