#!/usr/bin/env bash
# Issue 37's long checks on a GPU machine, in one call: the differential
# fuzz suite (tests/test_fuzz.py, CUFUSE_FUZZ=device) in parallel processes,
# every op family captured in a CUDA graph and replayed (scripts/graph_stress.py),
# and compute-sanitizer's racecheck, initcheck and synccheck over every
# kernel family (scripts/sanitize_all.py; memcheck: device_suite's call).
# Usage: bash scripts/reliability.sh [examples per fuzz process=9000] [replays=1000, 0: none]
# Subsets: FUZZ="norms rope" (tests), FUSED=0 (no fused programs), TOOLS="initcheck" (sanitizers).
# Logs under $OUT (default /tmp/reliability); prints each part's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/reliability}; mkdir -p "$OUT"
N=${1:-9000}; REPLAYS=${2:-1000}
export CUFUSE_FUZZ=device
pids=()
for t in ${FUZZ:-elementwise norms softmax_and_reductions quantize_round_trip cross_entropy rope}; do
  for copy in a b; do  # two processes per test: hypothesis draws other cases in each
    CUFUSE_FUZZ_EXAMPLES=$N timeout 480 python3 -m pytest -q -p no:cacheprovider --hypothesis-show-statistics \
      "tests/test_fuzz.py::test_fuzz_$t" >"$OUT/fuzz-$t-$copy.log" 2>&1 &
    pids+=($!)
  done
done
[ "${FUSED:-1}" = 1 ] && CUFUSE_FUZZ_EXAMPLES=$((N / 15)) timeout 480 python3 -m pytest -q -p no:cacheprovider --hypothesis-show-statistics \
  tests/test_fuzz.py::test_fuzz_fused_programs >"$OUT/fuzz-fused_programs.log" 2>&1 &
pids+=($!)
if [ "$REPLAYS" -gt 0 ]; then
  timeout 240 python3 scripts/graph_stress.py "$REPLAYS" >"$OUT/graph.log" 2>&1
  echo "graph stress: $(tail -n 1 "$OUT/graph.log")"; grep -v " 0 wrong" "$OUT/graph.log" | grep -i "wrong\|error" | head
fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
for tool in ${TOOLS:-racecheck initcheck synccheck}; do
  timeout 200 "$SAN" --tool "$tool" --error-exitcode 7 --print-limit 20 python3 scripts/sanitize_all.py \
    >"$OUT/san-$tool.log" 2>&1
  rc=$?
  echo "$tool rc=$rc: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/san-$tool.log" | tail -n 1)"
  [ $rc -ne 0 ] && grep -E -A6 "^========= (Uninitialized|Invalid|Race|Barrier|Error)" "$OUT/san-$tool.log" | head -n 40
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for f in "$OUT"/fuzz-*.log; do
  n=$(grep -A3 "during generate phase" "$f" | grep -oE "[0-9]+ passing" | grep -oE "^[0-9]+" | head -n 1)
  echo "$(basename "$f" .log): $(tail -n 1 "$f") (${n:-?} cases passed in the generate phase)"
done
grep -h -A15 "^E   \|Falsifying" "$OUT"/fuzz-*.log | head -n 60
exit $fail
