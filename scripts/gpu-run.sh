#!/usr/bin/env bash
# run.sh of a folder made by scripts/gpu-bundle: everything tapegrad checks on a GPU, in one call. The GPU
# tests; compute-sanitizer memcheck over the whole GPU suite, racecheck and synccheck over the kernels of
# the training step (forward, backward, fused AdamW, reductions: the compiled step of the benchmark, and
# the [ops] and [optim] test cases); the benchmarks; the example in f32 and bf16; with Nsight Compute, a
# per-kernel table of the training step; and the peer scripts (PyTorch with CUDA graphs, JAX with the
# loop in one jit, the codelab's own JAX code) on the same GPU, so ratios come from one run.
# The Vision Transformer example (f32 and bf16), its benchmark mode and its JAX reference's jitted step
# run too, and the DP-SGD example (per-example gradients by tg::vmap): its golden check, its step's
# examples/sec and its JAX reference's on the same GPU. TG_GPU_PARTS (default "all") picks parts: tests,
# sanitizers, bench, example, ncu, peers, vit, cnn, dp.
#   bash run.sh [RESULTS_DIR]      RESULTS_DIR: $OUT if set, else ./gpu-results
# Writes RESULTS_DIR/log.txt as it goes and RESULTS_DIR/results.tgz (every part's full log) at the end.
# Without a GPU (no nvidia-smi, or it lists none) it is a dry run: it checks that every binary finds its
# libraries, runs the tests that need no GPU and a short CPU run of the example, and says what it skipped.
set -u
g=$(cd "$(dirname "$0")" && pwd)
results=${1:-${OUT:-$PWD/gpu-results}}
mkdir -p "$results"
results=$(cd "$results" && pwd)
w=$(mktemp -d)
mkdir -p "$w/res"
log=$results/log.txt
: > "$log"
# The binaries and their libraries, unpacked for this run (bin/, lib/).
tar -xJf "$g/payload.tar.xz" -C "$w" || { echo "gpu-run: cannot unpack $g/payload.tar.xz" | tee -a "$log"; exit 1; }
bin=$w/bin
export LD_LIBRARY_PATH=$w/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TAPEGRAD_TEST_DATA=$g/testdata
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
say() { echo "== $* ($(date +%T))" | tee -a "$log"; }
# run SECONDS NAME command...: the command's output to res/NAME.log, its exit status and tail to log.txt.
run() {
  local t=$1 name=$2
  shift 2
  say "$name"
  timeout "$t" "$@" > "$w/res/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$w/res/$name.log"
  tail -n "${TAILN:-20}" "$w/res/$name.log" | tee -a "$log"
  if [ $rc -ne 0 ]; then failed+=("$name (exit $rc)"); fi
  return $rc
}
failed=()
skip() { say "$1: skipped, $2"; }
parts=" ${TG_GPU_PARTS:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }

say "machine"
cat "$g/MANIFEST" | tee -a "$log"
gpu=0
if command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then
  gpu=1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,memory.used --format=csv | tee -a "$log"
else
  echo "no GPU here (nvidia-smi missing or lists none): a dry run" | tee -a "$log"
fi
if grep -q '^TAPEGRAD_CHECK_BUILD:BOOL=ON' "$g/MANIFEST"; then
  if [ $gpu = 1 ]; then
    echo "gpu-run: this bundle is from a TAPEGRAD_CHECK_BUILD build (nvcc's host code and the benchmarks at -O0):" \
         "bundle a build configured without it for a GPU run" | tee -a "$log"
    exit 1
  fi
  echo "a TAPEGRAD_CHECK_BUILD bundle (host code at -O0): fine for a dry run, refused on a GPU" | tee -a "$log"
fi
unresolved=$(for f in "$bin"/*; do ldd "$f" | grep "not found" | sed "s|^|$(basename "$f"): |"; done | sort -u)
if [ -n "$unresolved" ]; then
  echo "libraries not found:" | tee -a "$log"
  echo "$unresolved" | tee -a "$log"
  # Without a CUDA toolkit only its own libraries may be missing; anything else is a bundling bug.
  if echo "$unresolved" | grep -v -E 'libcudart|libcublas|libnccl|libcuda\.' | grep -q .; then
    echo "gpu-run: a bundled binary lacks a non-CUDA library" | tee -a "$log"
    exit 1
  fi
  cuda_libs=0
else
  echo "every binary finds its libraries" | tee -a "$log"
  cuda_libs=1
fi

if [ $cuda_libs = 1 ]; then
  TAILN=4 run 120 cuda_host_tests "$bin/tapegrad_cuda_host_tests"
else
  skip cuda_host_tests "the CUDA runtime libraries are not on this machine"
fi

if [ $gpu = 1 ]; then
  if want tests; then
    TAILN=6 run 200 gpu_tests "$bin/tapegrad_gpu_tests"
    grep -B2 -A12 FAILED "$w/res/gpu_tests.log" | head -80 | tee -a "$log"
  fi
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null | head -1)
  if want vit; then
    TAILN=24 run 240 vit_fashion_mnist_cuda "$bin/vit_fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/vit_f32" --no-download \
      --golden "$g/vit_golden.json"
    TAILN=12 run 150 bench_train_step_cuda_vit "$bin/bench_train_step_cuda" --model vit --json "$w/res/vit_step_cuda.json"
    TAILN=2 run 150 jax_vit_f32 python3 "$g/vit_reference.py" bench --data-dir "$g/data" --steps 200 --dtype f32
    TAILN=10 run 150 vit_fashion_mnist_cuda_bf16 "$bin/vit_fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/vit_bf16" --no-download \
      --golden "$g/vit_golden.json" --dtype bf16 --epochs 4
    TAILN=2 run 150 jax_vit_bf16 python3 "$g/vit_reference.py" bench --data-dir "$g/data" --steps 200 --dtype bf16
    [ -n "$san" ] && TAILN=4 run 150 memcheck_transformer_ops "$san" --tool memcheck --error-exitcode 9 "$bin/tapegrad_gpu_tests" "[transformer]"
  fi
  if want cnn; then
    # The CNN's step (cuDNN convolutions) beside JAX + Flax's jitted step and lax.scan loop on the same GPU.
    TAILN=8 run 150 bench_train_step_cuda_cnn "$bin/bench_train_step_cuda" --model cnn --json "$w/res/cnn_step_cuda.json"
    TAILN=2 run 150 jax_cnn_f32 python3 "$g/cnn_reference.py" bench --data-dir "$g/data" --steps 200 --dtype f32
    TAILN=2 run 150 jax_cnn_bf16 python3 "$g/cnn_reference.py" bench --data-dir "$g/data" --steps 200 --dtype bf16
    [ -n "$san" ] && TAILN=4 run 150 memcheck_conv "$san" --tool memcheck --error-exitcode 9 "$bin/tapegrad_gpu_tests" "[conv]"
  fi
  if want dp; then
    TAILN=4 run 120 dp_sgd_cuda_golden "$bin/dp_sgd_cuda" --data-dir "$g/data" --no-download --golden "$g/dp_sgd_golden.json" --check-golden
    for b in 512 4096; do
      TAILN=1 run 120 "dp_sgd_cuda_bench_$b" "$bin/dp_sgd_cuda" --data-dir "$g/data" --no-download --bench 50 --batch-size $b
      TAILN=1 run 150 "jax_dp_sgd_$b" python3 "$g/dp_sgd_reference.py" bench --data-dir "$g/data" --batch-size $b --steps 50 --runs 3
    done
    TAILN=8 run 150 dp_sgd_cuda "$bin/dp_sgd_cuda" --data-dir "$g/data" --out "$w/res/dp_sgd" --no-download
    [ -n "$san" ] && TAILN=4 run 200 memcheck_vmap "$san" --tool memcheck --error-exitcode 9 "$bin/tapegrad_gpu_tests" "[vmap]"
  fi
  if [ -n "$san" ] && want sanitizers; then
    TAILN=6 run 300 memcheck "$san" --tool memcheck --error-exitcode 9 "$bin/tapegrad_gpu_tests"
    step=("$bin/bench_train_step_cuda" --batch 512 --runs 1 --steps 2 --json "$w/res/sanitized_step.json")
    for tool in racecheck synccheck; do
      TAILN=4 run 150 "${tool}_step" "$san" --tool "$tool" --error-exitcode 9 "${step[@]}"
      TAILN=4 run 200 "${tool}_ops_optim" "$san" --tool "$tool" --error-exitcode 9 "$bin/tapegrad_gpu_tests" "[ops],[optim]"
    done
  elif want sanitizers; then
    skip "compute-sanitizer" "not found"
  fi
  if want bench; then
    TAILN=24 run 90 bench_gemm_cuda "$bin/bench_gemm_cuda"
    TAILN=45 run 200 bench_train_step_cuda "$bin/bench_train_step_cuda" --json "$w/res/train_step_cuda.json" --sweep
  fi
  if want example; then
    TAILN=30 run 120 fashion_mnist_cuda "$bin/fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/fm_f32" --no-download
    TAILN=30 run 120 fashion_mnist_cuda_bf16 "$bin/fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/fm_bf16" --no-download --dtype bf16
  fi
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  if ! want ncu; then
    :
  elif [ -n "$ncu" ]; then
    for b in 512 8192; do
      TAILN=2 run 150 "ncu_$b" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        "$bin/bench_train_step_cuda" --batch $b --runs 1 --steps 2 --json "$w/res/ncu_step_$b.json"
    done
    python3 - "$w/res" << 'PY' | tee -a "$log"
import collections, csv, io, sys
for b in (512, 8192):
    try:
        text = open(f"{sys.argv[1]}/ncu_{b}.log").read()
        rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
        head = rows[0]
        name, value = head.index("Kernel Name"), head.index("Metric Value")
        by_kernel = collections.defaultdict(lambda: [0, 0.0])
        for r in rows[1:]:
            if len(r) == len(head):
                k = by_kernel[r[name][:100]]
                k[0] += 1
                k[1] += float(r[value].replace(",", ""))
        print(f"ncu, batch {b} (every mode of the benchmark, warm-up included): kernels by total time")
        for n, (count, ns) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  {count:5d} x {ns / count / 1e3:8.2f} us  {n}")
    except Exception as e:  # the table is a convenience; the raw CSV is in the archive
        print(f"batch {b}: ncu output unreadable: {e!r:.200}")
PY
  else
    skip "ncu per-kernel table" "Nsight Compute (ncu) not found"
  fi
  if ! want peers; then
    :
  elif ls "$g"/peers/*.py > /dev/null 2>&1; then
    if [ -f "$g/peers/torch_gpu.py" ]; then
      TAILN=14 run 240 torch_gpu python3 "$g/peers/torch_gpu.py" --data-dir "$g/data" --batches 512,4096 \
        --modes eager_f32,graph_f32,graph_f32_tf32,graph_bf16,inductor_graph_f32,inductor_graph_bf16
    fi
    if [ -f "$g/peers/jax_scan.py" ]; then
      for prec in highest default; do
        JAX_DEFAULT_MATMUL_PRECISION=$prec TAILN=6 run 120 "jax_scan_$prec" python3 "$g/peers/jax_scan.py" --data-dir "$g/data" \
          --batches 512,4096 --steps 200
      done
    fi
    [ -f "$g/peers/jax_codelab.py" ] && TAILN=4 run 120 jax_codelab python3 "$g/peers/jax_codelab.py" --data-dir "$g/data"
  else
    skip "peers" "no peer scripts in the bundle"
  fi
else
  for part in "gpu_tests" "memcheck over the GPU suite" "racecheck and synccheck over the training step's kernels" \
    "bench_gemm_cuda" "bench_train_step_cuda" "the example on the GPU (f32, bf16)" "ncu per-kernel table" "peers" \
    "the ViT example, its benchmark and its JAX peer on the GPU" "the DP-SGD example, its benchmark and its JAX peer on the GPU"; do
    skip "$part" "no GPU"
  done
  if [ $cuda_libs = 1 ]; then
    # The bundled example still runs, on the CPU (--device auto), which proves its libraries load.
    TAILN=6 run 120 fashion_mnist_cpu_fallback "$bin/fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/fm_cpu" \
      --no-download --steps 20 --log-every 10 --timing-steps 5 --quiet
    TAILN=6 run 120 vit_cpu_fallback "$bin/vit_fashion_mnist_cuda" --data-dir "$g/data" --out "$w/res/vit_cpu" --no-download \
      --golden "$g/vit_golden.json" --max-steps 20 --quiet
    TAILN=4 run 120 dp_sgd_cpu_fallback "$bin/dp_sgd_cuda" --data-dir "$g/data" --no-download --golden "$g/dp_sgd_golden.json" --check-golden
  fi
fi
say done
if [ ${#failed[@]} -eq 0 ]; then
  echo "all parts passed" | tee -a "$log"
else
  echo "failed: ${failed[*]}" | tee -a "$log"
fi
tar -czf "$results/results.tgz" -C "$w" res
echo "results: $log, $results/results.tgz" | tee -a "$log"
rm -rf "$w"
[ ${#failed[@]} -eq 0 ]
