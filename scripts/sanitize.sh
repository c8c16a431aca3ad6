#!/usr/bin/env bash
# compute-sanitizer over every kernel family (scripts/sanitize_driver.py):
# memcheck, racecheck, initcheck and synccheck, one process per tool and
# family. Prints one line per (tool, family) and a summary; exits 1 on any error.
# Needs a GPU and compute-sanitizer (CUDA toolkit) on PATH or in $CUDA_HOME/bin.
set -uo pipefail
cd "$(dirname "$0")/.."
SAN=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer 2>/dev/null \
      || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$SAN" ]; then echo "compute-sanitizer not found"; exit 2; fi
FAMILIES=${FAMILIES:-elementwise,activations,dropout,quantize,norms,softmax,reductions,fuse}
TOOLS=${TOOLS:-memcheck racecheck initcheck synccheck}
fail=0
for tool in $TOOLS; do
  for fam in ${FAMILIES//,/ }; do
    log=$(mktemp)
    "$SAN" --tool "$tool" --error-exitcode 7 --print-limit 20 python3 scripts/sanitize_driver.py "$fam" >"$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
    if [ $rc -ne 0 ]; then fail=1; echo "FAIL $tool $fam (rc $rc): $summary"; tail -n 30 "$log";
    else echo "ok   $tool $fam: $summary"; fi
    rm -f "$log"
  done
done
[ $fail -eq 0 ] && echo "compute-sanitizer: every family clean" || echo "compute-sanitizer: errors above"
exit $fail
