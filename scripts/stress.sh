#!/usr/bin/env bash
# The stress check (issue #29): the test suite with both cores busy beside it and in a
# shuffled order, to find tests that hold only on a quiet machine or in one order.
# Not part of CI's timed path (scripts/test.sh and .ci/run keep the fixed order, no hog).
#
#   scripts/stress.sh                        whole suite, 1 run, a CPU hog per core, shuffled
#   scripts/stress.sh -m "not e2e"           extra arguments go to pytest
#   scripts/stress.sh --runs 3               three runs in a row, a new seed each
#   scripts/stress.sh --seed 1234 tests/x    replay one order (the seed is printed)
#   scripts/stress.sh --no-hog | --no-shuffle | --hogs N | --hog-nice N
#   scripts/test.sh --stress ...             the same
#
# The hog: N busy-loop processes (default: one per core, `nproc`), each bounded by
# `timeout` (--hog-max-s, default 7200) and killed by PID when the runs end, at nice
# --hog-nice (default 0: they compete with the suite as equals, like other work on a
# shared machine). The shuffle: pytest-randomly (`-p randomly --randomly-seed=S`; it also
# reseeds `random`, numpy and torch per test from S). With pytest-xdist every worker uses
# the same seed. A failing run prints the command that replays its order.
# Environment: CKPT_TEST_WORKERS (xdist workers, default 2, as scripts/test.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs=1 seed="" hog=1 shuffle=1 hogs="$(nproc)" hog_nice=0 hog_max_s=7200
args=()
while (($#)); do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --no-hog) hog=0; shift ;;
    --no-shuffle) shuffle=0; shift ;;
    --hogs) hogs="$2"; shift 2 ;;
    --hog-nice) hog_nice="$2"; shift 2 ;;
    --hog-max-s) hog_max_s="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
  export PATH="$PWD/.venv/bin:$PATH"
else
  py=python3  # a checkout without its own .venv (scripts/setup.sh makes one)
fi
"$py" -c 'import pytest_randomly' 2>/dev/null || {
  echo "error: pytest-randomly is not installed (scripts/setup.sh installs the dev extra)" >&2
  exit 1
}

hog_pids=()
stop_hog() {
  local pid
  for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hog_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  hog_pids=()
}
trap stop_hog EXIT
trap 'stop_hog; exit 130' INT TERM

if ((hog)); then
  for ((i = 0; i < hogs; i++)); do
    nice -n "$hog_nice" timeout "$hog_max_s" sh -c 'while :; do :; done' &
    hog_pids+=("$!")
  done
  echo "stress: CPU hog: $hogs busy loop(s) at nice $hog_nice (pids ${hog_pids[*]}), at most ${hog_max_s}s"
fi

failed=0
for ((r = 1; r <= runs; r++)); do
  order=(-p no:randomly)
  this_seed=""
  if ((shuffle)); then
    this_seed="${seed:-$(( (RANDOM << 15 | RANDOM) % 1000000000 ))}"
    order=(-p randomly "--randomly-seed=$this_seed")
  fi
  echo "stress: run $r/$runs, seed ${this_seed:-none (fixed order)}, load $(cut -d' ' -f1-3 /proc/loadavg)"
  t0=$(date +%s)
  if "$py" -m pytest -n "${CKPT_TEST_WORKERS:-2}" --dist loadgroup "${order[@]}" "${args[@]}"; then
    echo "stress: run $r passed in $(( $(date +%s) - t0 ))s (seed ${this_seed:-none})"
  else
    failed=$((failed + 1))
    echo "stress: run $r FAILED in $(( $(date +%s) - t0 ))s; replay: scripts/stress.sh" \
      "${this_seed:+--seed $this_seed }${args[*]}" >&2
  fi
done
stop_hog
echo "stress: $((runs - failed))/$runs run(s) passed"
((failed == 0))
