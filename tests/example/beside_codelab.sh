#!/usr/bin/env bash
# The example with the codelab's settings (its defaults) stands beside the codelab's own numbers
# (examples/fashion_mnist/codelab_golden.json, from scripts/codelab_golden.py): the same shuffle and keys
# give the same first-batch loss to 1e-6 relative (and the one-step numbers), the same 25 sample test
# images, and, after 400 AdamW steps, a test accuracy within 0.01; the table is in report.html.
#   beside_codelab.sh path/to/fashion_mnist
set -euo pipefail
exe=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --no-download --quiet --out "$out/run"
grep -q "10. Beside the codelab" "$out/run/report.html"
/usr/bin/python3 - "$out/run/metrics.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
c = m["codelab"]
rows = {r["number"]: r for r in c["rows"]}
failures = []
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok: failures.append(what)
check(c["comparable"], "the run has the codelab's settings")
check(c["same_sample_images"], "the 25 sample test images are the codelab's")
for name in ["first-batch loss (key(1))", "loss after one SGD step (lr 3e-3)", "one compiled AdamW step (key(2)): loss",
             "  batch accuracy", "  gradient norm"]:
    r = rows[name]
    check(r["relative"] <= 1e-6, f"{name.strip()}: {r['tapegrad']:.8f} vs the codelab's {r['codelab']:.8f} (relative {r['relative']:.1e} <= 1e-6)")
r = rows["test accuracy after 400 steps"]
check(abs(r["tapegrad"] - r["codelab"]) <= 0.01, f"test accuracy {r['tapegrad']:.4f} vs {r['codelab']:.4f} (within 0.01)")
r = rows["test loss after 400 steps"]
check(r["relative"] <= 0.02, f"test loss {r['tapegrad']:.4f} vs {r['codelab']:.4f} (within 2%)")
sys.exit(1 if failures else 0)
PY
