#!/usr/bin/env bash
# The example data parallel on the CPU: `mpirun -np 2 fashion_mnist --data-parallel` (each rank half of
# every global batch of 512, gradients averaged over MPI) against one process on the whole batches. The
# final parameters agree within a tolerance (only the summation order of the gradient mean differs), the
# two ranks' parameters and optimizer state are identical (the example compares hashes), rank 0 alone
# prints and writes the outputs. Under `mpirun -np 1`, --data-parallel is bitwise the plain run. (The
# 2-rank difference, about 4e-5, appears in the first AdamW step and does not grow: a few gradient
# entries of w2 are ~1e-8, where Adam's g / (|g| + 1e-8) turns a rounding difference into a visible one.)
#   data_parallel.sh path/to/fashion_mnist mpirun -np 2 [mpirun options...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exe=$1; shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
opts=(--no-download --steps 40 --log-every 10 --timing-steps 2)

OMP_NUM_THREADS=2 "$exe" --quiet "${opts[@]}" --out "$work/one"
"$@" "$exe" --data-parallel "${opts[@]}" --out "$work/two" >"$work/two.log" 2>&1 || { cat "$work/two.log"; echo "FAIL: mpirun"; exit 1; }

one_rank=("$@"); one_rank[2]=1  # the same mpirun command with -np 1
"${one_rank[@]}" "$exe" --quiet --data-parallel "${opts[@]}" --out "$work/np1"
cmp -s "$work/one/params.safetensors" "$work/np1/params.safetensors" && echo "ok   mpirun -np 1 --data-parallel is bitwise the plain run" \
  || { echo "FAIL: mpirun -np 1 --data-parallel differs from the plain run"; exit 1; }
grep -q "2 ranks (MPI)" "$work/two.log" && echo "ok   the setup table shows 2 ranks" || { echo "FAIL: no '2 ranks (MPI)'"; exit 1; }
grep -q "identical (hash compared)" "$work/two.log" && echo "ok   parameters and optimizer state identical on both ranks" \
  || { cat "$work/two.log"; echo "FAIL: no identity line"; exit 1; }
n=$(grep -c "^== 1\. " "$work/two.log" || true)
[ "$n" = 1 ] && echo "ok   one rank logs" || { echo "FAIL: the setup step printed $n times (rank 0 alone should log)"; exit 1; }
/usr/bin/python3 "$here/compare_params.py" "$work/one/params.safetensors" "$work/two/params.safetensors" 1e-4  # Debian's python3-numpy
