#!/usr/bin/env python3
"""scripts/check_layers.py catches what it is for: each violation below, planted in a copy of include/,
must make it fail with its message; the untouched copy must pass. (ctest include_layers_catches)

  check_layers_catches.py path/to/scripts/check_layers.py path/to/include
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

checker, include = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

# (what, file under include/tapegrad, text appended after its includes or replacing a line, expected message)
CASES = [
    ("an upward include", "runtime/dispatch.hpp", ('#include "tapegrad/config.hpp"', '#include "tapegrad/config.hpp"\n#include "tapegrad/ops/elementwise.hpp"'),
     "includes ops/elementwise.hpp (ops) from the lower layer runtime"),
    ("a folder including a higher folder (tree -> optim)", "tree/pytree.hpp", ('#include "tapegrad/config.hpp"', '#include "tapegrad/config.hpp"\n#include "tapegrad/optim/base.hpp"'),
     "folder tree/ includes the higher folder optim/"),
    ("a CUDA API call in an op", "ops/reduce.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\ninline void sync_now() { cudaDeviceSynchronize(); }"),
     "names the vendor API 'cudaDeviceSynchronize' in ops"),
    ("a cuBLASLt name in compile", "compile/compile.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\nusing Handle = cublasLtHandle_t;"),
     "names the vendor API 'cublasLtHandle_t' in compile"),
    ("a oneDNN name in optim", "optim/base.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\ninline int alg() { return dnnl_eltwise_relu; }"),
     "names the vendor API 'dnnl_eltwise_relu' in optim"),
    ("OpenMP in optim", "optim/update.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\ninline void loop(int n, float* x) {\n#pragma omp parallel for\n  for (int i = 0; i < n; ++i) x[i] = 0; }"),
     "OpenMP in optim"),
    ("#if TG_WITH_CUDA in an op", "ops/nn.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\n#if defined(TG_WITH_CUDA)\ninline int cuda_only = 1;\n#endif"),
     "#if on TG_WITH_CUDA in ops"),
    ("an include after code", "ops/indexing.hpp", ("TG_BEGIN_NAMESPACE", "TG_BEGIN_NAMESPACE\n#include <map>"),
     "#include after code"),
    ("a folder that is no layer", "misc/helper.hpp", None, "its folder is no layer"),
]


def run(root):
    return subprocess.run([sys.executable, str(checker), str(root)], capture_output=True, text=True)


failures = 0
with tempfile.TemporaryDirectory() as tmp:
    clean = pathlib.Path(tmp) / "clean"
    shutil.copytree(include, clean)
    r = run(clean)
    if r.returncode != 0:
        print("FAIL the untouched tree does not pass:\n" + r.stdout)
        failures += 1
    else:
        print("ok   the untouched tree passes")
    for what, rel, edit, message in CASES:
        root = pathlib.Path(tmp) / what.replace(" ", "_").replace("#", "").replace("/", "_")
        shutil.copytree(include, root)
        path = root / "tapegrad" / rel
        if edit is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text('#pragma once\n#include "tapegrad/config.hpp"\n')
        else:
            old, new = edit
            text = path.read_text()
            assert old in text, (rel, old)
            path.write_text(text.replace(old, new, 1))
        r = run(root)
        if r.returncode == 1 and message in r.stdout:
            print(f"ok   {what}: {next(l for l in r.stdout.splitlines() if message in l)}")
        else:
            print(f"FAIL {what}: exit {r.returncode}, expected 1 and '{message}' in:\n{r.stdout}")
            failures += 1
print(f"check_layers_catches: {len(CASES) + 1 - failures} of {len(CASES) + 1} passed")
sys.exit(1 if failures else 0)
