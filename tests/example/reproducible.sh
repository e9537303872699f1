#!/usr/bin/env bash
# Reproducibility on the CPU, through the example on the real data: the same options give bitwise-
# identical final parameters run to run and with 1 or 2 OpenMP threads; and training N steps straight
# equals N/2 steps, --save, then --resume to N (parameters compared byte for byte, metadata included).
#   reproducible.sh path/to/fashion_mnist
set -euo pipefail
exe=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # run <name> <threads> [options...]
  local name=$1 threads=$2; shift 2
  OMP_NUM_THREADS=$threads "$exe" --quiet --no-download --timing-steps 2 --log-every 10 --out "$work/$name" "$@"
}
same() {  # same <what> <a> <b>
  if cmp -s "$work/$2/params.safetensors" "$work/$3/params.safetensors"; then echo "ok   $1"
  else echo "FAIL $1: $2 and $3 differ"; exit 1; fi
}
run a 2 --steps 40
run b 2 --steps 40
same "run to run, 2 threads" a b
run c 1 --steps 40
same "1 thread vs 2 threads" a c
run half 2 --steps 20 --save "$work/half.safetensors"
run resumed 2 --steps 40 --resume "$work/half.safetensors"
same "40 steps straight vs 20 + --save / --resume + 20" a resumed
# A checkpoint from other options is refused, naming the option.
if out=$(run wrong 2 --steps 40 --seed 5 --resume "$work/half.safetensors" 2>&1); then echo "FAIL: resumed with another seed"; exit 1; fi
grep -q "saved with seed = 0, this run has 5" <<<"$out" && echo "ok   a checkpoint of another seed is refused" || { echo "FAIL: $out"; exit 1; }
