"""Every call on the per-decode-step path that would wait for the device if its tensor lived there (``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``int(...)``, ``bool(...)``, ``float(...)``), read from the source of the
path's functions, is listed here with why it reads host data. A new one fails this test until it is named.

The path: SGLang's decode check (``room_for_windows``), the cache manager's ``alloc_to_lengths`` before every
forward, the request tables' flush, and the attention backend's metadata (the CUDA-graph hooks a decode step on a
GPU runs; the eager ``init_forward_metadata`` and its index). ``benchmarks/decode_step_syncs.py`` runs the same
path on a GPU under ``torch.cuda.set_sync_debug_mode('error')``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_dsv4

PACKAGE = Path(sglang_dsv4.__file__).parent
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy"}
SYNCING_BUILTINS = {"int", "bool", "float"}

# module -> the per-step functions in it, by qualified name
PER_STEP_PATH = {
    "prefix_cache/manager.py": [
        "CacheManager.alloc_to_lengths",
        "CacheManager.steps_plainly",
        "CacheManager._reserve_run",
        "CacheManager.room_for_windows",
        "CacheManager.window_slots_for_forward",
    ],
    "prefix_cache/checkpoints.py": ["Checkpoints.due_at", "Checkpoints.between"],
    "memory_pool/request_tables.py": [
        "MirroredTable.write_cells",
        "MirroredTable.flush",
        "RequestTables.flush",
        "RequestTables.begin_forward",
        "RequestTables.steps_plainly",
        "RequestTables.step_each",
        "RequestTables.window_slots_for_forward",
    ],
    "memory_pool/shared_rows.py": ["SharedRows.recycle_each", "SharedRows.take_each", "SharedRows._take"],
    "attention_backend/batched_backend.py": [
        "BatchedBackend.init_forward_metadata",
        "BatchedBackend.init_forward_metadata_out_graph",
        "BatchedBackend.init_forward_metadata_in_graph",
        "batch_plan",
    ],
    "attention_backend/torch_reference.py": ["request_spans"],
    "attention_backend/batched.py": [
        "build_index",
        "build_decode_index",
        "DecodeGraphIndex.stage_checkpoints",
        "DecodeGraphIndex.build",
        "DecodeGraphIndex.build_in_torch",
        "DecodeGraphIndex.build_in_kernels",
        "_stage_checkpoints",
        "_Batch.of",
        "_index",
        "_index_of",
        "_tile_owners",
        "_window_index",
        "_compressor_targets",
        "_entry_reads",
    ],
}

HOST_TABLES = "the request tables and SharedRows' counts are host tensors on every platform (the device reads twins)"
# (module, function, call) -> why the value is host data, not device data
EXPECTED = {
    ("prefix_cache/manager.py", "CacheManager.alloc_to_lengths", "req_pool_indices_cpu.tolist()"): (
        "SGLang's host copy of the batch's request rows (ReqToTokenPool.alloc's *_cpu arguments)"
    ),
    ("prefix_cache/manager.py", "CacheManager.alloc_to_lengths", "target_seq_lens_cpu.tolist()"): (
        "SGLang's host copy of the batch's new lengths"
    ),
    ("prefix_cache/manager.py", "CacheManager._reserve_run", "int(target)"): "a Python int from the host list",
    ("memory_pool/shared_rows.py", "SharedRows.recycle_each", "int(taking.sum())"): HOST_TABLES,
    ("memory_pool/request_tables.py", "RequestTables.step_each", "trimmed.tolist()"): HOST_TABLES,
    ("memory_pool/request_tables.py", "RequestTables.step_each", "takes.tolist()"): HOST_TABLES,
    # The eager metadata: a decode step on a GPU runs the CUDA-graph hooks instead (up to the graphs' batch size).
    ("attention_backend/torch_reference.py", "request_spans", "forward_batch.req_pool_indices.tolist()"): (
        "eager forwards only: a device tensor on a GPU (a sync there), the CPU's own tensor here"
    ),
    ("attention_backend/torch_reference.py", "request_spans", "forward_batch.positions[offsets].tolist()"): (
        "eager verify and draft-extend forwards only (a device tensor on a GPU)"
    ),
    ("attention_backend/torch_reference.py", "request_spans", "forward_batch.spec_info.num_accept_tokens.tolist()"): (
        "eager draft-extend forwards only (a device tensor on a GPU)"
    ),
    ("attention_backend/torch_reference.py", "request_spans", "seq_lens.tolist()"): (
        "SGLang's host copy seq_lens_cpu where it has one (decode); else eager forwards' seq_lens"
    ),
    ("attention_backend/torch_reference.py", "request_spans", "int(start)"): "host values from the lists above",
    ("attention_backend/torch_reference.py", "request_spans", "int(length)"): "host values from the lists above",
}


def syncing_calls(module: str, qualname: str) -> list[str]:
    """The source of every call in the function that reads a tensor's value on the host (or would)."""
    tree = ast.parse((PACKAGE / module).read_text())
    node = find(tree, qualname.split("."))
    calls = []
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        function = call.func
        if isinstance(function, ast.Attribute) and function.attr in SYNCING_METHODS:
            calls.append(ast.unparse(call))
        elif isinstance(function, ast.Name) and function.id in SYNCING_BUILTINS:
            calls.append(ast.unparse(call))
    return calls


def find(tree: ast.AST, names: list[str]) -> ast.AST:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == names[0]:
            return node if len(names) == 1 else find(node, names[1:])
    raise LookupError(f"no {'.'.join(names)}")


def test_every_host_read_on_the_per_step_path_is_named_with_why_it_is_host_data():
    found = {
        (module, qualname, call)
        for module, functions in PER_STEP_PATH.items()
        for qualname in functions
        for call in syncing_calls(module, qualname)
    }
    assert found == set(EXPECTED)


def test_the_decode_graph_hooks_read_no_device_value_on_the_host():
    """What a GPU decode step in a CUDA graph runs of ours: none of it reads a device tensor's value."""
    graph_path = [
        ("attention_backend/batched_backend.py", "BatchedBackend.init_forward_metadata_out_graph"),
        ("attention_backend/batched_backend.py", "BatchedBackend.init_forward_metadata_in_graph"),
        ("attention_backend/batched.py", "DecodeGraphIndex.stage_checkpoints"),
        ("attention_backend/batched.py", "_stage_checkpoints"),
        ("attention_backend/batched.py", "DecodeGraphIndex.build_in_kernels"),
        ("attention_backend/batched.py", "DecodeGraphIndex.build_in_torch"),
        ("memory_pool/request_tables.py", "MirroredTable.flush"),
    ]
    assert [call for module, name in graph_path for call in syncing_calls(module, name)] == []
