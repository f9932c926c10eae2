"""The package's imports keep its layers: each imports only from below it, and no module imports itself back.

Every top-level module and package of ``sglang_dsv4`` sits in one layer of :data:`LAYERS`, lowest first:

1. what everything reads: the V4 config (``config``, ``configs/``), the plugin's settings, and the hooks the
   plugin requires of SGLang (``required_hooks``: the check; the list is the plugin's);
2. ``served_config``: the config a checkpoint is served with;
3. ``kernels/``: tensors in, tensors out;
4. ``model/``: the V4 network, its MoE (gate, experts, SGLang's ``FusedMoE``), the loader, SGLang's model classes;
5. ``memory_pool/``: the pool's rows, plain torch;
6. ``prefix_cache/``: checkpoints, the cache manager, the tree;
7. ``kv_cache``: the pool as SGLang's ``KVCache``;
8. ``attention_backend/``: the attention backends SGLang calls, handed that pool;
9. - 11. the SGLang adapters: the radix-cache seam, the CPU platform, DP routing, request serving; then data
   parallelism, quantization, speculation and emulation (an H200 emulated) over them; then ``plugin``, which
   installs them all;
12. - 15. the tools: EP planning (``moe/``), AgentPerf, the launcher, the chat template and the public names; then
   ``tiny``; then ``demo``; then ``cli``.

The check is drawn per top-level module, not only per layer: an import from one top-level module or package into
another must go to a strictly lower layer, so two of one layer import nothing from each other. Inside a package
its modules import each other freely, without cycles. Every import in the package's source is counted — at module
level, inside functions and under ``TYPE_CHECKING`` alike — read from the source with :mod:`ast`, so a new cycle
or a new import that reaches up or sideways fails here. No exception stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_dsv4

PACKAGE = Path(sglang_dsv4.__file__).parent
LAYERS = (
    ("config", "configs", "settings", "required_hooks"),
    ("served_config",),
    ("kernels",),
    ("model",),
    ("memory_pool",),
    ("prefix_cache",),
    ("kv_cache",),
    ("attention_backend",),
    ("radix_cache", "platform", "routing", "serving"),
    ("data_parallel", "quantization", "speculation", "disaggregation", "emulation"),
    ("plugin",),
    ("moe", "agentperf", "launch", "chat_template", "__init__"),
    ("tiny",),
    ("demo",),
    ("cli",),
)


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


def top(name: str) -> str:
    """The top-level module or package ``name`` belongs to (``__init__`` for the package itself)."""
    return name.split(".")[1] if "." in name else "__init__"


def layer(name: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if top(name) in names)


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


def test_every_name_in_a_layer_is_a_top_level_module():
    assert {top(name) for name in modules()} == {name for names in LAYERS for name in names}


def test_every_import_between_top_level_modules_goes_to_a_lower_layer():
    # Per module: two top-level modules of one layer import nothing from each other.
    sideways_or_up = {
        (name, target)
        for name, targets in graph().items()
        for target in targets
        if top(target) != top(name) and layer(target) >= layer(name)
    }
    assert sideways_or_up == set()


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
