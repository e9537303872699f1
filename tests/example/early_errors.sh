#!/usr/bin/env bash
# What goes wrong mid-run is said early and plainly: an output folder that cannot be written fails before
# training (exit 2, naming it and why, nothing written); a diverging run (--lr 1e30) stops at the first
# logged non-finite loss (exit 1) with the step, the likely cause and the --check-numerics hint.
#   early_errors.sh path/to/fashion_mnist
set -uo pipefail
exe=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
run() {  # run EXPECTED_EXIT PATTERN... -- ARGS...
  local code=$1; shift
  local patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done; shift
  local start=$SECONDS
  "$exe" --no-download --quiet "$@" 2> "$work/err" > /dev/null
  local got=$? took=$((SECONDS - start)) ok=1
  [ "$got" -eq "$code" ] || { echo "FAIL [$*]: exit $got, expected $code"; ok=0; }
  for p in "${patterns[@]}"; do grep -Eq -- "$p" "$work/err" || { echo "FAIL [$*]: stderr lacks /$p/"; ok=0; }; done
  if [ $ok -eq 1 ]; then echo "ok   exit $got after ${took}s: $(head -c 300 "$work/err" | tr '\n' ' ')"; else failures=$((failures + 1)); cat "$work/err"; fi
}
# Unwritable output folders: before any training, so well under the run's length.
run 2 "--out /proc/forbidden: cannot create this folder" "choose a writable place" -- --out /proc/forbidden --steps 400
touch "$work/a_file"
run 2 "--out $work/a_file/sub: cannot create this folder" -- --out "$work/a_file/sub"
grep -q "Beside" "$work/err" && { echo "FAIL: trained before failing"; failures=$((failures + 1)); }
# Divergence: stops at the first logged step whose loss is not finite (here step 1: the warm-up step
# already diverged), and writes nothing.
run 1 "training loss is (-?nan|-?inf) at step [0-9]+ \(the first logged step" "diverged" "--lr 1e\+30" "--check-numerics" -- --lr 1e30 --out "$work/diverged"
[ -e "$work/diverged" ] && { echo "FAIL: $work/diverged was written"; failures=$((failures + 1)); }
[ $failures -eq 0 ] && echo "early_errors: all passed" || { echo "early_errors: $failures failure(s)"; exit 1; }
