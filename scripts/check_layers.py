#!/usr/bin/env python3
"""Checks that tapegrad's headers depend on each other in one direction (docs/architecture.md).

Each folder of include/tapegrad is one layer, and a header's layer is its folder's (the files at the top,
config.hpp and the umbrella headers, are the lowest and highest layers). The order of the layers, lowest
first, is LAYERS below. The check, per header and per folder:
- a header includes headers of its own layer or of lower ones, never of a higher one;
- headers of one layer do not include each other in a cycle;
- no #include comes after the first line of code (a line that is not blank, a comment or a directive);
- a header that opens the tapegrad namespace includes config.hpp, where TG_BEGIN_NAMESPACE is defined;
- the vendor APIs are named only in their layers: CUDA runtime, cuBLAS/cuBLASLt, cuDNN and oneDNN names,
  kernel launches (<<< >>>) and __global__ only in runtime/ and backend/; OpenMP (#pragma omp, omp_*)
  only in runtime/ and backend/; nothing above runtime/ and backend/ writes `#if ... TG_WITH_CUDA` except
  distributed/ (NCCL, its own transport);
- every folder is a layer, so a new folder is placed deliberately.

  scripts/check_layers.py [-v] [include_dir]   exit 0: clean; 1: each violation printed; -v: each layer's
                                               dependencies
"""
import pathlib
import re
import sys

# (layer, what it is), lowest first; the folder under include/tapegrad is the layer's name. "config" is the
# file config.hpp, "umbrella" the other files at the top (tapegrad.hpp, build_info.hpp).
LAYERS = [
    ("config", "version, TG_HD, TG_WITH_CUDA, the ABI namespace macros"),
    ("base", "plain C++: errors, bf16, dtypes, shapes"),
    ("math", "the math written once: functors with their derivatives, the activation table"),
    ("runtime", "devices, storage, the device dispatch, compile's recording hook; cpu/ and cuda/"),
    ("core", "the tape and Tensor"),
    ("random", "JAX's PRNG, NumPy's generator"),
    ("backend", "one door per vendor library: GEMMs (oneDNN, cuBLASLt), oneDNN's eltwise"),
    ("ops", "the differentiable ops and the multi-tensor launcher"),
    ("tree", "pytrees"),
    ("autodiff", "grad, value_and_grad, check_grads, the numerics guard"),
    ("optim", "Optax's transformations"),
    ("compile", "tg::compile"),
    ("data", "IDX files, fixed batches"),
    ("io", "safetensors checkpoints"),
    ("distributed", "data parallelism over MPI and NCCL"),
    ("umbrella", "tapegrad.hpp, build_info.hpp"),
]
NAMES = [name for name, _ in LAYERS]
VENDOR_LAYERS = {"runtime", "backend"}
# distributed/ speaks NCCL (its own transport) and keeps its #if TG_WITH_CUDA; it names no CUDA API.
CUDA_IF_LAYERS = VENDOR_LAYERS | {"config", "base", "distributed", "umbrella"}

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](tapegrad/[^>"]+)[>"]')
ANY_INCLUDE = re.compile(r"^\s*#\s*include\b")
VENDOR_API = re.compile(r"\b(cuda[A-Z]\w*|cublas(Lt)?[A-Z]\w*|cublas\w*_t|CUBLAS\w*|CUDA_R_\w+|cudnn[A-Z]\w*|cudnn\w*_t|CUDNN_\w+|dnnl_\w+|DNNL_\w+|__global__)\b|<<<")
OPENMP = re.compile(r"^\s*#\s*pragma\s+omp\b|\bomp_\w+\s*\(")
CUDA_IF = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*\bTG_WITH_CUDA\b")


def layer_of(rel):
    """The layer index of a header path relative to include/tapegrad, or None."""
    parts = rel.split("/")
    if len(parts) == 1:
        return NAMES.index("config") if rel == "config.hpp" else NAMES.index("umbrella")
    return NAMES.index(parts[0]) if parts[0] in NAMES else None


def code_lines(text):
    """(line number, line, is_code, code) for each line, with block comments followed across lines; `code`
    is the line without comments and string literals (for the name checks)."""
    in_comment = False
    for number, line in enumerate(text.splitlines(), 1):
        code = ""
        rest = line
        is_code = False
        while rest:
            if in_comment:
                end = rest.find("*/")
                if end < 0:
                    rest = ""
                    break
                in_comment = False
                rest = rest[end + 2:]
                continue
            stripped = rest.lstrip()
            if not stripped:
                break
            if stripped.startswith("//"):
                break
            if stripped.startswith("/*"):
                in_comment = True
                rest = stripped[2:]
                continue
            # code up to the next comment start
            cut = len(rest)
            for marker in ("//", "/*"):
                at = rest.find(marker)
                if at >= 0:
                    cut = min(cut, at)
            code += rest[:cut]
            rest = rest[cut:]
            if not rest:
                break
        code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
        stripped_code = code.strip()
        is_code = bool(stripped_code) and not stripped_code.startswith("#")
        yield number, line, is_code, code


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    root = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parent.parent / "include"
    base = root / "tapegrad"
    headers = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.hpp"))
    problems = []
    graph = {}
    folder_edges = {}
    for rel in headers:
        layer = layer_of(rel)
        if layer is None:
            problems.append(f"{rel}: its folder is no layer of scripts/check_layers.py; add the folder to LAYERS and "
                            f"docs/architecture.md, or move the header into a layer's folder")
            continue
        name = NAMES[layer]
        graph[rel] = []
        text = (base / rel).read_text()
        if "TG_BEGIN_NAMESPACE" in text and rel != "config.hpp" and '#include "tapegrad/config.hpp"' not in text:
            problems.append(f'{rel}: opens the tapegrad namespace (TG_BEGIN_NAMESPACE) without #include "tapegrad/config.hpp"')
        seen_code = None
        for number, line, is_code, code in code_lines(text):
            if is_code and seen_code is None:
                seen_code = number
            if ANY_INCLUDE.match(line) and seen_code is not None:
                problems.append(f"{rel}:{number}: #include after code (line {seen_code}); move it to the top of the file")
            if name not in VENDOR_LAYERS:
                m = VENDOR_API.search(code)
                if m:
                    problems.append(f"{rel}:{number}: names the vendor API '{m.group(0)}' in {name}; CUDA, cuBLAS, cuDNN and "
                                    f"oneDNN are spoken only in runtime/ and backend/ (add a function there)")
                if OPENMP.search(code):
                    problems.append(f"{rel}:{number}: OpenMP in {name}; the CPU's loops live in runtime/cpu/ (and the "
                                    f"backend's in backend/cpu/): use tg::detail::index_map or the multi-tensor launcher")
            if name not in CUDA_IF_LAYERS and CUDA_IF.match(code):
                problems.append(f"{rel}:{number}: #if on TG_WITH_CUDA in {name}; backend choices live behind per-device "
                                f"functions in runtime/ and backend/ (a build without CUDA gets their stub)")
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)[len("tapegrad/"):]
            graph[rel].append(target)
            target_layer = layer_of(target)
            if target_layer is None or not (base / target).is_file():
                problems.append(f"{rel}:{number}: includes {target}, which is not a header of any layer")
                continue
            if target_layer > layer:
                problems.append(f"{rel}:{number}: includes {target} ({NAMES[target_layer]}) from the lower layer "
                                f"{name}; a layer may include only its own and lower layers")
            folder_edges.setdefault((name, NAMES[target_layer]), []).append(f"{rel}:{number}")
    # Per folder: the folder graph must follow the order (this restates the per-file rule for folders, and
    # prints each folder's dependencies for the reader).
    for (src, dst), where in sorted(folder_edges.items()):
        if NAMES.index(dst) > NAMES.index(src):
            problems.append(f"folder {src}/ includes the higher folder {dst}/ ({', '.join(where)})")
    # Cycles (possible only inside one layer, as the order forbids them across layers).
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                problems.append("include cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt in graph and nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    for p in problems:
        print(p)
    if "-v" in sys.argv:
        for src in NAMES:
            below = sorted({dst for (s, dst) in folder_edges if s == src and dst != src}, key=NAMES.index)
            print(f"  {src:9s} -> {', '.join(below) if below else '(nothing)'}")
    folders = sorted({NAMES[layer_of(h)] for h in headers if layer_of(h) is not None}, key=NAMES.index)
    print(f"check_layers: {len(headers)} headers in {len(folders)} layers, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
