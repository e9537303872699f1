#!/usr/bin/env python3
"""Checks that tapegrad's headers depend on each other in one direction (docs/architecture.md).

Every header under include/tapegrad belongs to one layer of LAYERS, lowest first. A header may include
headers of its own layer or of a lower one, never of a higher one; headers of one layer must not include
each other in a cycle; nothing above ops includes a backend header (the umbrella header excepted); and no
#include comes after the first line of code (a line that is not blank, a comment or a preprocessor
directive); and a header that opens the tapegrad namespace includes config.hpp, where the name of its
ABI namespace is defined. Every header must be listed, so a new one is placed deliberately.

  scripts/check_layers.py [include_dir]      exit 0: clean; 1: each violation printed
"""
import fnmatch
import pathlib
import re
import sys

# (layer, patterns relative to include/tapegrad), lowest first.
LAYERS = [
    ("config", ["config.hpp"]),
    ("base", ["core/error.hpp", "core/bf16.hpp", "core/dtype.hpp", "core/shape.hpp"]),
    ("runtime", ["core/device.hpp", "core/storage.hpp", "backend/cpu/loops.hpp", "backend/cpu/denormals.hpp",
                 "backend/cuda/check.hpp", "backend/cuda/context.hpp", "backend/cuda/launch.hpp"]),
    ("core", ["core/tape.hpp", "core/recorder.hpp", "core/tensor.hpp"]),
    ("random", ["random/*.hpp"]),
    ("gemm", ["backend/cpu/onednn.hpp", "backend/cuda/blaslt.hpp"]),
    ("ops", ["ops/*.hpp"]),
    ("tree", ["tree/*.hpp"]),
    ("autodiff", ["autodiff/*.hpp"]),
    ("optim", ["optim/*.hpp"]),
    ("compile", ["compile/*.hpp"]),
    ("data", ["data/*.hpp"]),
    ("io", ["io/*.hpp"]),
    ("dist", ["dist/*.hpp"]),
    ("umbrella", ["tapegrad.hpp", "build_info.hpp"]),
]
OPS = [name for name, _ in LAYERS].index("ops")
UMBRELLA = len(LAYERS) - 1

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](tapegrad/[^>"]+)[>"]')
ANY_INCLUDE = re.compile(r"^\s*#\s*include\b")


def layer_of(rel):
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatch(rel, p) for p in patterns):
            return index
    return None


def code_lines(text):
    """(line number, line, is_code) for each line, with block comments followed across lines."""
    in_comment = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        is_code = False
        rest = stripped
        while rest:
            if in_comment:
                end = rest.find("*/")
                if end < 0:
                    rest = ""
                    break
                in_comment = False
                rest = rest[end + 2:].strip()
                continue
            if rest.startswith("//"):
                break
            if rest.startswith("/*"):
                in_comment = True
                rest = rest[2:]
                continue
            if rest.startswith("#"):
                break
            is_code = True
            break
        yield number, line, is_code


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "include")
    headers = sorted(p.relative_to(root / "tapegrad").as_posix() for p in (root / "tapegrad").rglob("*.hpp"))
    problems = []
    graph = {}
    for rel in headers:
        layer = layer_of(rel)
        if layer is None:
            problems.append(f"{rel}: not in any layer of scripts/check_layers.py; add it to LAYERS and docs/architecture.md")
            continue
        graph[rel] = []
        text = (root / "tapegrad" / rel).read_text()
        # The ABI namespace's name comes from config.hpp: a header that opens it without including
        # config.hpp first would open a namespace literally named TG_ABI when included on its own.
        if "inline TG_ABI" in text and rel != "config.hpp" and '#include "tapegrad/config.hpp"' not in text:
            problems.append(f'{rel}: opens the tapegrad namespace (TG_ABI) without #include "tapegrad/config.hpp"')
        seen_code = None
        for number, line, is_code in code_lines(text):
            if is_code and seen_code is None:
                seen_code = number
            if ANY_INCLUDE.match(line) and seen_code is not None:
                problems.append(f"{rel}:{number}: #include after code (line {seen_code}); move it to the top of the file")
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)[len("tapegrad/"):]
            graph[rel].append(target)
            target_layer = layer_of(target)
            if target_layer is None:
                problems.append(f"{rel}:{number}: includes {target}, which is in no layer")
            elif target_layer > layer:
                problems.append(f"{rel}:{number}: includes {target} ({LAYERS[target_layer][0]}) from the lower layer "
                                f"{LAYERS[layer][0]}; a layer may include only its own and lower layers")
            if target.startswith("backend/") and OPS < layer < UMBRELLA:
                problems.append(f"{rel}:{number}: includes the backend header {target} from {LAYERS[layer][0]}; "
                                f"backends are reached only through ops")
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
    print(f"check_layers: {len(headers)} headers in {len(LAYERS)} layers, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
