"""llama.cpp, ctypes and ggml may be imported only by the llama.cpp engine's modules
(shard/engine/llama.py and the parts it is composed of, shard/engine/llama_*.py but the pure
state reader llama_state.py); purerpc's
internals, h2 and its frame libraries only by the shard/rpc/transport package.

Everything else talks to the engine through the project-owned contract (shard.engine), so the
transport and tests never depend on the native library's types. The scan is static (``ast``):
it sees imports inside functions and ``try`` blocks too, and ``importlib.import_module`` /
``__import__`` calls with a literal module name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shard"
ALLOWED = {
    Path("shard/engine/llama.py"),
    Path("shard/engine/llama_ahead.py"),
    Path("shard/engine/llama_batch.py"),
    Path("shard/engine/llama_capture.py"),
    Path("shard/engine/llama_embed.py"),
    Path("shard/engine/llama_kv.py"),
    Path("shard/engine/llama_model.py"),
    Path("shard/engine/llama_native.py"),
    Path("shard/engine/llama_threads.py"),
    Path("shard/engine/llama_tick.py"),
}
FORBIDDEN = ("llama_cpp", "ctypes", "ggml")


def _forbidden(module: str | None) -> bool:
    if not module:
        return False
    top = module.split(".")[0]
    return top in FORBIDDEN or top.startswith("ggml") or top.startswith("_ctypes")


def forbidden_imports(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, module) for every import of a forbidden module in ``source``."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, a.name) for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _forbidden(node.module):
                hits.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _forbidden(arg.value):
                    hits.append((node.lineno, arg.value))
    return hits


def scan_package() -> dict[str, list[tuple[int, str]]]:
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel in ALLOWED:
            continue
        hits = forbidden_imports(path.read_text(encoding="utf-8"), str(rel))
        if hits:
            found[str(rel)] = hits
    return found


def test_only_the_llama_engine_imports_native_modules() -> None:
    assert list(PACKAGE.rglob("*.py")), "the scan found no source files"
    assert scan_package() == {}


@pytest.mark.parametrize(
    "source",
    [
        "import ctypes",
        "import llama_cpp",
        "import llama_cpp.llama_cpp as ll",
        "from llama_cpp import Llama",
        "from llama_cpp.llama_cpp import llama_batch",
        "from ctypes import c_int, POINTER",
        "import os, ctypes.util",
        "import ggml",
        "from ggml_python import x",
        "def f():\n    try:\n        import llama_cpp\n    except ImportError:\n        pass",
        "import importlib\nm = importlib.import_module('llama_cpp')",
        "m = __import__('ctypes')",
    ],
)
def test_scanner_flags_offending_sources(source: str) -> None:
    assert forbidden_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np",
        "from shard.engine import ShardEngine",
        "from . import ctypes_free",
        "from .llama_helpers import x",
        "import gguf",  # the GGUF file format library is not ggml itself
        "text = 'import ctypes'",
    ],
)
def test_scanner_accepts_clean_sources(source: str) -> None:
    assert forbidden_imports(source) == []


def test_scanner_reports_the_offending_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\nfrom ctypes import CDLL\n")
    assert forbidden_imports(bad.read_text(), str(bad)) == [(2, "ctypes")]


# ---- purerpc internals and h2 belong to the transport ------------------------------------------

TRANSPORT = Path("shard/rpc/transport")
WIRE_LIBRARIES = ("h2", "hpack", "hyperframe")


def wire_internal_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for imports of purerpc's internals (``purerpc.<sub>``) or of h2 (and the
    hpack / hyperframe libraries under it).

    ``import purerpc`` itself (``Service``, ``RPCSignature``: its public API, which the
    generated stubs and the health service use) is allowed everywhere.
    """
    hits = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.lineno, node.module)]
        hits += [(line, mod) for line, mod in names
                 if mod.startswith("purerpc.") or mod.split(".")[0] in WIRE_LIBRARIES]
    return hits


def test_only_the_transport_touches_purerpc_internals_and_h2() -> None:
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if TRANSPORT not in path.relative_to(ROOT).parents
        and (hits := wire_internal_imports(path.read_text(encoding="utf-8")))
    }
    assert found == {}
    inside = sorted((ROOT / TRANSPORT).glob("*.py"))
    assert {p.name for p in inside} >= {"__init__.py", "wire.py", "server.py", "client.py"}
    for path in inside:
        if path.name != "__init__.py":  # each module does touch them: the scanner sees it
            assert wire_internal_imports(path.read_text(encoding="utf-8")), path.name


@pytest.mark.parametrize("source", [
    "from purerpc.grpclib.connection import GRPCConnection",
    "import h2.events",
    "import purerpc.grpclib.buffers as b",
    "from hyperframe.frame import GoAwayFrame",
    "import hpack",
])
def test_wire_scanner_flags_internal_imports(source: str) -> None:
    assert wire_internal_imports(source)


def test_wire_scanner_accepts_the_public_purerpc_api() -> None:
    assert wire_internal_imports("import purerpc\nfrom purerpc import Service") == []


# ---- leaf modules and the direction of shard.models -> shard.engine -----------------------------

#: Leaf modules: shared value types and errors. They may import only the project modules listed.
LEAVES = {
    Path("shard/errors.py"): set(),
    Path("shard/layers.py"): {"shard.errors"},
}


def project_imports(source: str, package: str) -> set[str]:
    """Every ``shard.*`` module ``source`` imports (relative imports resolved against
    ``package``, the importing module's package)."""
    found: set[str] = set()
    for node, module in _imports(source, package):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "shard"}
        elif module.split(".")[0] == "shard":
            found.add(module)
    return found


def _imports(source: str, package: str) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``source`` with the module a ``from`` import names (relative
    ones resolved against ``package``; "" for a plain ``import``)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.append((node, ""))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node, ".".join([*base, node.module] if node.module else base)))
            else:
                found.append((node, node.module or ""))
    return found


def _module_package(path: Path) -> str:
    """The package a module's relative imports start from (a package's ``__init__``: itself)."""
    return ".".join(path.relative_to(ROOT).parent.parts)


def test_leaf_modules_import_only_their_allowed_project_modules() -> None:
    for rel, allowed in LEAVES.items():
        path = ROOT / rel
        assert project_imports(path.read_text(encoding="utf-8"), _module_package(path)) <= allowed, rel


def test_model_tools_never_import_the_engine() -> None:
    """shard.models (the slicer, the architecture table, the model writers) sits below the
    engine: the engine reads the table and loads slices, never the other way round."""
    found = {}
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        hits = {m for m in project_imports(path.read_text(encoding="utf-8"), _module_package(path))
                if m == "shard.engine" or m.startswith("shard.engine.")}
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}


@pytest.mark.parametrize(
    ("source", "package", "expected"),
    [
        ("from shard.engine.types import LayerRange", "shard.models", {"shard.engine.types"}),
        ("from ..engine import x", "shard.models", {"shard.engine"}),
        ("from . import write", "shard.models", {"shard.models"}),
        ("import shard.layers, numpy", "shard", {"shard.layers"}),
        ("import gguf", "shard.models", set()),
    ],
)
def test_project_import_scanner(source: str, package: str, expected: set[str]) -> None:
    assert project_imports(source, package) == expected


# ---- one-way layering: no import circles, and each side imports only what is below it ---------


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, modules: set[str]) -> str | None:
    """The project module an import names (``from a import b``: ``a.b`` if that is a module)."""
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def import_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (anywhere in it: function-level
    and ``TYPE_CHECKING`` imports count too, since a circle through them is a circle all the
    same), its own package's ``__init__`` excluded."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = _module_package(path)
        targets: set[str] = set()
        for node, module in _imports(path.read_text(encoding="utf-8"), package):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [f"{module}.{a.name}" for a in node.names]  # a submodule, or module
            for n in names:
                target = _resolve(n, modules)
                if target is not None and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a list of modules, the first repeated at the end)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_project_has_no_import_circle() -> None:
    graph = import_graph()
    assert {"shard.pipeline.chain", "shard.relay.routed", "shard.rpc.session"} <= set(graph)
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = import_graph()
    graph["shard.rpc.session"] = graph["shard.rpc.session"] | {"shard.relay.routed"}
    cycle = find_cycle(graph)
    assert cycle is not None and "shard.relay.routed" in cycle and "shard.rpc.session" in cycle


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


#: (importer prefix, importer exceptions, modules it must not import). The two sides of a chain
#: sit side by side above the client of one worker: the worker's relay (``shard.relay``, which
#: plugs into the server through ``shard.rpc.session``'s protocols) and the client pipeline
#: (``shard.pipeline``); neither imports the other, and nothing below them imports either.
LAYERS = [
    ("shard.engine", (), ("shard.rpc", "shard.client", "shard.pipeline", "shard.relay", "shard.cli")),
    ("shard.rpc", (), ("shard.client", "shard.pipeline", "shard.relay", "shard.cli")),
    ("shard.relay", (), ("shard.pipeline", "shard.cli")),
    ("shard.client", (), ("shard.pipeline", "shard.relay", "shard.rpc.session",
                          "shard.rpc.servicer", "shard.rpc.registry", "shard.rpc.server", "shard.cli")),
    ("shard.pipeline", (), ("shard.relay", "shard.rpc.session", "shard.rpc.servicer",
                            "shard.rpc.registry", "shard.rpc.server", "shard.cli")),
    # leaves both sides share ("shard" bans every project module)
    ("shard.deadlines", (), ("shard",)),
    ("shard.stops", (), ("shard.engine", "shard.rpc", "shard.client", "shard.pipeline", "shard.cli")),
    ("shard.rpc.routes", (), ("shard",)),
]


def layering_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    found = []
    for importer, imports in graph.items():
        for prefix, exceptions, banned in LAYERS:
            if not _under(importer, prefix) or _under(importer, *exceptions):
                continue
            found += [(importer, m) for m in sorted(imports)
                      if _under(m, *banned) and not _under(m, prefix)]
    return sorted(set(found))


def test_each_side_imports_only_what_lies_below_it() -> None:
    assert layering_violations(import_graph()) == []


def test_the_layering_check_finds_a_planted_violation() -> None:
    graph = import_graph()
    graph["shard.relay.policy"] = graph["shard.relay.policy"] | {"shard.pipeline.runner"}
    graph["shard.pipeline.chain"] = graph["shard.pipeline.chain"] | {"shard.relay.routed"}
    assert set(layering_violations(graph)) >= {
        ("shard.relay.policy", "shard.pipeline.runner"),
        ("shard.pipeline.chain", "shard.relay.routed"),
    }


# ---- the HTTP front door's libraries belong to shard/api ----------------------------------------

WEB_LIBRARIES = ("starlette", "hypercorn", "pydantic", "jinja2")
WEB_ALLOWED = (Path("shard/api"), Path("shard/chat.py"))


def web_imports(source: str) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in WEB_LIBRARIES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in WEB_LIBRARIES:
                hits.append((node.lineno, node.module))
    return hits


def test_only_the_front_door_imports_web_libraries() -> None:
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path.relative_to(ROOT).is_relative_to(a) for a in WEB_ALLOWED)
        and (hits := web_imports(path.read_text(encoding="utf-8")))
    }
    assert found == {}
    assert web_imports("from starlette.routing import Route\nimport jinja2.sandbox")
