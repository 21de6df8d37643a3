"""The package's shape: layers import one way, no import cycles, short functions.

Checked from the source with ``ast`` (function-level imports included), so a
cycle hidden inside a function body is found too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "specstream_mlx"
CONVERT = ROOT / "convert"

# Each layer may import itself and the layers listed for it (and nothing above).
ALLOWED = {
    "models": {"settings"},
    "method": {"models", "settings"},
    "io": {"models", "method", "settings"},
    "runtime": {"models", "method", "io", "platform_info", "cpu_jit", "settings"},
    "convert": {"models", "method", "io", "settings"},
    "train": {"models", "method", "io", "settings"},
    "tasks": {"models", "method", "io", "runtime", "settings"},
    "serve": {"models", "method", "io", "runtime", "tasks", "settings"},
    "bench": {"models", "method", "io", "runtime", "platform_info", "settings"},
    "demo": {"models", "method", "io", "runtime", "train", "convert", "tasks", "settings"},
    "cli": {
        "models",
        "method",
        "io",
        "runtime",
        "train",
        "convert",
        "serve",
        "bench",
        "platform_info",
        "tasks",
        "settings",
        "user_cache",
    },
    "user_cache": {"cpu_jit", "platform_info", "settings"},
    "platform_info": {"cpu_jit", "openblas_core", "settings"},
    "openblas_core": {"cpu_jit", "settings"},
    "cpu_jit": {"settings"},
    "settings": set(),
}


def _modules():
    """module name -> source path for the package (convert mapped in as specstream_mlx.convert)."""
    out = {}
    for base, prefix in ((PKG, "specstream_mlx"), (CONVERT, "specstream_mlx.convert")):
        for f in base.rglob("*.py"):
            rel = f.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = f
    return out


def _imports(name: str, path: Path, modules) -> set:
    """Package modules ``name`` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    pkg_parts = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("specstream_mlx"):
                found.add(t)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_layers_import_one_way(graph):
    bad = []
    for mod, deps in graph.items():
        layer = _layer(mod)
        if layer not in ALLOWED:
            continue  # the package root and __main__ may import anything
        for d in deps:
            other = _layer(d)
            if other and other != layer and other not in ALLOWED[layer]:
                bad.append(f"{mod} -> {d}")
    assert not bad, "layer violations:\n" + "\n".join(sorted(bad))


def test_no_import_cycles(graph):
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_over_100_lines():
    long = []
    for f in list(PKG.rglob("*.py")) + list(CONVERT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


def test_one_decoder_block():
    """Only the architectures (models/base.py, and gemma3_text.py for Gemma's four-norm
    block over the same attention) run a block's sublayers (attention, MLP, norms)
    themselves; every other MLX module calls the block. The one exception is the PyTorch
    backend's block over transformers' modules (train/torch_objective.py), which
    test_torch_backend.py holds equal to these."""
    offenders = []
    allowed = {PKG / "models" / "base.py", PKG / "models" / "gemma3_text.py", PKG / "train" / "torch_objective.py"}
    for f in list(PKG.rglob("*.py")) + list(CONVERT.rglob("*.py")):
        if f in allowed:
            continue
        src = f.read_text()
        if ".post_attention_layernorm(" in src or ".input_layernorm(" in src or ".self_attn.project(" in src:
            offenders.append(str(f.relative_to(ROOT)))
    assert not offenders, offenders


def test_every_setting_the_docs_and_scripts_name_is_read_by_the_software():
    """examples/first_request.sh set SPECSTREAM_CACHE_DIR after the package had stopped
    reading it, so its "empty cost store" was the user's own. Every SPECSTREAM_* variable
    that a script, the Makefile, CI or the docs name must be one the package (Python or the
    native forwarder) or the Swift client reads."""
    import re

    root = Path(__file__).resolve().parents[1]
    name = re.compile(r"SPECSTREAM_[A-Z][A-Z_]*[A-Z]")

    def names(paths):
        return {n for p in paths if p.is_file() for n in name.findall(p.read_text(errors="replace"))}

    readers = [*(root / "specstream_mlx").rglob("*.py"), *(root / "specstream_mlx").rglob("*.c")]
    readers += [*(root / "examples" / "swift" / "Sources").rglob("*.swift")]
    readers += [*(root / "examples" / "swift" / "Tests").rglob("*.swift")]
    named = [root / "Makefile", root / ".ci" / "run", root / "README.md", *(root / "docs").glob("*.md")]
    named += [p for p in (root / "examples").iterdir() if p.suffix in (".py", ".sh")]
    unread = names(named) - names(readers)
    assert not unread, f"named but read nowhere: {sorted(unread)}"
