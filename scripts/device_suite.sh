#!/usr/bin/env bash
# The whole test suite on the device machine in one call, as parallel shards
# (one GPU is shared; 16 cores). Logs go to $OUT/suite-<n>.log; prints each
# shard's summary line, every FAILED/ERROR line and the skip reasons counted;
# the shard logs are joined into $OUT/suite.log (the device tool brings back
# only a few files), each with its slowest tests (--durations), by which the
# shards are balanced. Exit status 1 if any shard failed.
# Usage: bash scripts/device_suite.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the examples the tests run as subprocesses import cufuse from here
OUT=${OUT:-/tmp/suite}; mkdir -p "$OUT"
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
  python3 -m pytest -q -rfEs --durations=8 --maxfail=10 -p no:cacheprovider ${SHARDS[$i]} "$@" >"$OUT/suite-$i.log" 2>&1 &
  pids+=($!)
done
fail=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || fail=1
  echo "shard $i (${SHARDS[$i]}): $(tail -n 1 "$OUT/suite-$i.log")"
done
grep -hE "^(FAILED|ERROR) " "$OUT"/suite-*.log | head -n 40
echo "skip reasons:"
grep -h "^SKIPPED" "$OUT"/suite-*.log | sed -E 's/^SKIPPED \[[0-9]+\] [^:]+:[0-9]+: //' | sort | uniq -c | sort -rn | head -n 20
for i in "${!SHARDS[@]}"; do echo "=== shard $i: ${SHARDS[$i]}"; cat "$OUT/suite-$i.log"; done >"$OUT/suite.log"
rm -f "$OUT"/suite-*.log
exit $fail
