#!/usr/bin/env bash
# Two fresh clones run `make test` side by side, N times each in a row: one with ONEDNN_MAX_CPU_ISA unset, the
# other with it set to AVX2 (issue 28: the suite must pass while another suite loads the machine, whatever oneDNN's
# instruction set). Each clone builds its own .venv first (make venv), as CI does.
#
#   [BUSY=B] benchmarks/concurrent_make_test.sh [N=3] [WORK_DIR=/tmp/saeflow-pair]
#
# BUSY=B adds B processes that spin on the CPU for as long as the suites run ("other work": issue 32 asks the suite to
# pass at 8x load, a load average of 16 on 2 cores). The load average is sampled every 30 s while the suites run and
# summarized at the end (WORK_DIR/load.log holds every sample).
# Prints one line per run (clone, round, exit code, wall seconds) and exits non-zero if any run failed; each run's
# output is kept in WORK_DIR/<clone>-<round>.log.
set -uo pipefail
trap 'trap - INT TERM; kill 0' INT TERM  # stopped: stop both suites too (pytest-xdist would restart killed workers)
n_rounds=${1:-3}
work_dpath=${2:-/tmp/saeflow-pair}
busy_pids=()
repo_dpath=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work_dpath"

run_clone() {  # name, then the ISA setting ("" = unset)
    local name=$1 isa=$2 clone_dpath="$work_dpath/$1"
    rm -rf "$clone_dpath" && git clone -q "$repo_dpath" "$clone_dpath"
    make -C "$clone_dpath" venv >"$work_dpath/$name-venv.log" 2>&1 || { echo "$name venv failed"; return 1; }
    local failed=0
    for round in $(seq 1 "$n_rounds"); do
        local t0=$SECONDS rc
        if [ -n "$isa" ]; then
            ONEDNN_MAX_CPU_ISA=$isa make -C "$clone_dpath" test >"$work_dpath/$name-$round.log" 2>&1
        else
            env -u ONEDNN_MAX_CPU_ISA make -C "$clone_dpath" test >"$work_dpath/$name-$round.log" 2>&1
        fi
        rc=$?
        echo "$name round $round: exit $rc, $((SECONDS - t0)) s, $(grep -Eo '[0-9]+ passed[^=]*' "$work_dpath/$name-$round.log" | tail -1)"
        [ "$rc" -eq 0 ] || failed=1
    done
    return $failed
}

for _ in $(seq 1 "${BUSY:-0}"); do
    python3 -c 'while True: pass' & busy_pids+=($!)
done
(while sleep 30; do cut -d' ' -f1 /proc/loadavg; done) >"$work_dpath/load.log" & sampler_pid=$!
run_clone isa-unset "" & pid_unset=$!
run_clone isa-avx2 AVX2 & pid_avx2=$!
wait $pid_unset; rc_unset=$?
wait $pid_avx2; rc_avx2=$?
kill "$sampler_pid" "${busy_pids[@]}" 2>/dev/null
awk '{ s += $1; if ($1 > m) m = $1; if (n == 0 || $1 < lo) lo = $1; n++ }
     END { if (n) printf "load average over %d samples: mean %.1f, min %.1f, max %.1f (%d cores)\n", n, s / n, lo, m, '"$(nproc)"' }' \
    "$work_dpath/load.log"
[ "$rc_unset" -eq 0 ] && [ "$rc_avx2" -eq 0 ]
