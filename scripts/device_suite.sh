#!/usr/bin/env bash
# The whole test suite on the device machine in one call, as parallel shards
# (one GPU is shared; 16 cores; about 280 s on an H200 machine). Each shard's
# log goes to $LOGS/suite-<n>.log, and as each shard ends its summary line and
# FAILED/ERROR lines are added to $OUT/summary.txt, so a call cut by its time
# limit still brings back what finished (the device tool brings back only a
# few files). At the end: prints the summaries, failures and skip reasons
# counted, and joins the logs into $OUT/suite.log, each with its slowest tests
# (--durations), by which the shards are balanced. Exit status 1 if any shard
# failed.
# Usage: bash scripts/device_suite.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the examples the tests run as subprocesses import cufuse from here
# one Inductor compile worker per shard: a fresh machine compiles every CPU test's C++ anew, and by
# default each of the shards starts a pool of workers as large as the machine (a compiled CPU test took
# 84 s here, 5 s on a 2-core machine with a warm cache)
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
OUT=${OUT:-/tmp/suite}; LOGS=${LOGS:-/tmp/suite-logs}; mkdir -p "$OUT" "$LOGS"; : >"$OUT/summary.txt"
# without a usable GPU the tests marked cuda are deselected (tests/conftest.py): say so and stop
python3 -c "import sys, cufuse; sys.exit(0 if cufuse.CUDA_AVAILABLE else 'cufuse.CUDA_AVAILABLE is False: no GPU tests would run')" || exit 1
SHARDS=(
  "tests/test_fuse.py"
  "tests/test_norm.py"
  "tests/test_autograd.py"
  "tests/test_driver.py"
  "tests/test_cross_entropy.py tests/test_rope.py"
  "tests/test_fake_quantize.py tests/test_fuse_autograd.py"
  "tests/test_nn.py tests/test_patch.py tests/test_distributed.py"
  "tests/test_errors.py tests/test_quantize.py"
  "tests/test_elementwise.py tests/test_interop.py"
  "tests/test_reduction.py tests/test_dropout.py tests/test_tiles.py tests/test_bfloat16.py tests/test_gelu.py"
  "tests/test_fuzz.py tests/test_dask.py tests/test_runtime.py tests/test_fuse_build.py tests/test_packaging.py tests/test_bench_tool.py"
)
# every test file is in exactly one shard
listed=" ${SHARDS[*]} "
for f in tests/test_*.py; do
  case "$listed" in *" $f "*) ;; *) SHARDS+=("$f");; esac
done
pids=()
for i in "${!SHARDS[@]}"; do
  (
    python3 -m pytest -q -rfEs --durations=8 --maxfail=10 -p no:cacheprovider ${SHARDS[$i]} "$@" >"$LOGS/suite-$i.log" 2>&1
    rc=$?
    { echo "shard $i (${SHARDS[$i]}): $(tail -n 1 "$LOGS/suite-$i.log")"
      grep -E "^(FAILED|ERROR) " "$LOGS/suite-$i.log" | head -n 20; } >>"$OUT/summary.txt"
    exit $rc
  ) &
  pids+=($!)
done
fail=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || fail=1
done
cat "$OUT/summary.txt"
echo "skip reasons:"
grep -h "^SKIPPED" "$LOGS"/suite-*.log | sed -E 's/^SKIPPED \[[0-9]+\] [^:]+:[0-9]+: //' | sort | uniq -c | sort -rn | head -n 20
for i in "${!SHARDS[@]}"; do echo "=== shard $i: ${SHARDS[$i]}"; cat "$LOGS/suite-$i.log"; done >"$OUT/suite.log"
rm -f "$LOGS"/suite-*.log
exit $fail
