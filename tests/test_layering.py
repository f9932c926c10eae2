"""The package's imports keep its layers: each imports only from below it, and no module imports itself back.

The layers, lowest first (DESIGN.md): the config and settings; ``kernels/`` (tensors in, tensors out);
the V4 network (``model/``, ``moe/``); ``memory_pool/`` (the pool's rows, plain torch); ``prefix_cache/``
(checkpoints, the cache manager, the tree); ``attention_backend/``; then the SGLang adapters and tools.
Every import in the package's source is counted — at module level, inside functions and under
``TYPE_CHECKING`` alike — read from the source with :mod:`ast`, so a new cycle or a new import that
reaches up a layer fails here. The exceptions are named, each with why it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_dsv4

PACKAGE = Path(sglang_dsv4.__file__).parent
LAYERS = (
    ("config", "configs", "settings", "required_hooks"),
    ("kernels",),
    ("model",),
    ("moe",),
    ("memory_pool",),
    ("prefix_cache",),
    ("attention_backend",),
    ("kv_cache", "radix_cache", "plugin", "platform", "quantization", "served_config", "serving", "data_parallel",
     "speculation", "routing", "launch", "tiny", "chat_template", "agentperf", "demo", "cli", "__init__"),
)  # fmt: skip
# Imports that reach up a layer, and why they stand.
UPWARD = {
    # SGLang's model class lives beside the network it adapts; it reads the served config.
    ("sglang_dsv4.model.sglang_model", "sglang_dsv4.served_config"),
    # So does SGLang's draft model (the MTP layer) beside it.
    ("sglang_dsv4.model.sglang_draft", "sglang_dsv4.served_config"),
    # The SGLang-facing backends are handed the pool as SGLang's KVCache.
    ("sglang_dsv4.attention_backend.pool_bound", "sglang_dsv4.kv_cache"),
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("sglang_dsv4") and candidate != name:
                targets.add(candidate)
    return targets


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names)


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer():
    for name in modules():
        layer(name)  # raises StopIteration for a top-level name no layer lists


def test_no_module_imports_from_a_layer_above_it_but_the_named_exceptions():
    upward = {
        (name, target)
        for name, targets in graph().items()
        for target in targets
        if layer(target) > layer(name)
    }
    assert upward == UPWARD


def test_no_import_cycle():
    # Four when first counted: the tables and window policy, the network and its kernel calls, the loader and
    # checkpoint check, the plugin and SGLang's model class. None may come back.
    assert cycles(graph()) == set()


def test_the_pool_and_its_tables_import_nothing_from_the_prefix_cache():
    edges = graph()
    for name in ("sglang_dsv4.memory_pool.request_tables", "sglang_dsv4.memory_pool.shared_rows",
                 "sglang_dsv4.memory_pool.storage"):  # fmt: skip
        assert not any(target.startswith("sglang_dsv4.prefix_cache") for target in edges[name]), name


def test_only_the_dispatch_module_chooses_between_triton_and_torch():
    # kernels/dispatch.py's uses_triton is the one device choice; every other module calls its operations.
    choosers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            imported = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            if "uses_triton" in (named, *imported):
                choosers.add(name)
    assert choosers == {"sglang_dsv4.kernels.dispatch"}
