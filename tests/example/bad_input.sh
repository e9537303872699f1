#!/usr/bin/env bash
# The Fashion-MNIST example on bad input: no data anywhere, damaged or wrong files, bad flags. Each case
# must exit 2 (CLI11's own code for a bad flag) with a message naming the file and the problem, and leave
# nothing under --out.  Usage: bad_input.sh path/to/fashion_mnist
set -uo pipefail
exe=$1
src=/usr/share/datasets/fashion-mnist
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# Runs the example on data dir $1 (with no other place to look) and expects exit $2 and stderr matching
# every further argument (grep -E patterns).
expect() {
  local dir=$1 code=$2; shift 2
  local out="$work/out" err="$work/err" extra=()
  if [ "${1:-}" = "--" ]; then shift; while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift; fi
  rm -rf "$out"
  HOME="$work/home" TAPEGRAD_DATA= TAPEGRAD_SYSTEM_DATA="$work/nosystem" \
    "$exe" --data-dir "$dir" --out "$out" --no-download --quiet --steps 2 --timing-steps 1 "${extra[@]}" 2>"$err" >/dev/null
  local got=$?
  local ok=1
  [ "$got" -eq "$code" ] || { echo "FAIL [$dir ${extra[*]}]: exit $got, expected $code"; ok=0; }
  for pattern in "$@"; do
    grep -Eq -- "$pattern" "$err" || { echo "FAIL [$dir ${extra[*]}]: stderr lacks /$pattern/"; ok=0; }
  done
  [ -e "$out" ] && { echo "FAIL [$dir ${extra[*]}]: $out was created"; ok=0; }
  if [ $ok -eq 1 ]; then echo "ok   exit $got: $(head -c 160 "$err" | tr '\n' ' ')"; else failures=$((failures + 1)); sed 's/^/     /' "$err"; fi
}

# A copy of the real data with one file replaced by $2 (a command writing the new file to stdout).
variant() {
  local name=$1 file=$2; shift 2
  local d="$work/$name"
  mkdir -p "$d"
  cp "$src"/*.gz "$d"/
  "$@" > "$d/$file.new" && mv "$d/$file.new" "$d/$file"
  echo "$d"
}

# No data anywhere: every searched path, and both ways to get the data.
mkdir -p "$work/empty"
expect "$work/empty" 2 "Fashion-MNIST not found" "$work/empty \(incomplete\)" "$work/home/.cache/tapegrad/fashion-mnist" \
  "$work/nosystem/fashion-mnist" "apt-get install dataset-fashion-mnist" "put the four .gz files" "--no-download"

# A truncated .gz, and one with flipped bytes.
d=$(variant truncated train-labels-idx1-ubyte.gz head -c 20000 "$src/train-labels-idx1-ubyte.gz")
expect "$d" 2 "$d/train-labels-idx1-ubyte.gz" "truncated or corrupt"
d=$(variant corrupt t10k-images-idx3-ubyte.gz bash -c "head -c 3000 '$src/t10k-images-idx3-ubyte.gz'; head -c 5000 /dev/zero; tail -c +8001 '$src/t10k-images-idx3-ubyte.gz'")
expect "$d" 2 "$d/t10k-images-idx3-ubyte.gz" "corrupt"

# Valid gzip, wrong content: the checksum catches it...
labels_with() {  # t10k labels with byte $1 (0-based) of the payload replaced by octal $2
  zcat "$src/t10k-labels-idx1-ubyte.gz" > "$work/payload"
  printf "\\$2" | dd of="$work/payload" bs=1 seek="$1" conv=notrunc status=none
  gzip -c "$work/payload"
}
d=$(variant mismatch t10k-labels-idx1-ubyte.gz labels_with 20 '003')
expect "$d" 2 "$d/t10k-labels-idx1-ubyte.gz" "SHA-256 of the decompressed data is [0-9a-f]{64}, not Fashion-MNIST's 0402a96d"
# ... and with --no-verify the structure checks still do.
d=$(variant badlabel t10k-labels-idx1-ubyte.gz labels_with 20 '014')
expect "$d" 2 -- --no-verify -- "$d/t10k-labels-idx1-ubyte.gz" "label 12 of example 12 is outside 0..9"
d=$(variant magic t10k-labels-idx1-ubyte.gz labels_with 1 '010')
expect "$d" 2 -- --no-verify -- "$d/t10k-labels-idx1-ubyte.gz" "not an IDX file: the magic number starts with bytes 0, 8"
short_labels() { (printf '\000\000\010\001\000\000\047\017'; zcat "$src/t10k-labels-idx1-ubyte.gz" | tail -c +9 | head -c 9999) | gzip -c; }
d=$(variant dims t10k-labels-idx1-ubyte.gz short_labels)
expect "$d" 2 -- --no-verify -- "$d/t10k-labels-idx1-ubyte.gz" "shape \(9999,\), expected \(10000,\)"
long_images() { (zcat "$src/t10k-images-idx3-ubyte.gz"; printf 'xx') | gzip -c; }
d=$(variant trailing t10k-images-idx3-ubyte.gz long_images)
expect "$d" 2 -- --no-verify -- "$d/t10k-images-idx3-ubyte.gz" "trailing bytes"

# Training that diverges, under the numerics guard: stops at the first NaN / Inf, naming the leaf.
expect "$src" 1 -- --check-numerics --lr 1e37 -- "\[check_numerics\] (loss|gradient) at step [0-9]+: '[^']+' holds a NaN or Inf"

# Bad flags: CLI11's message and its exit code (105: a value that fails validation; 109: an unknown option).
expect "$work/empty" 105 -- --steps -3 -- "--steps: Value -3 not in range 1 to 10000000"
expect "$work/empty" 105 -- --dtype f16 -- "--dtype: f16 not in"
expect "$work/empty" 109 -- --bogus -- "The following argument was not expected: --bogus"

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
