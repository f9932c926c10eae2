"""The decode index built by the Triton kernels (what a CUDA graph's decode forward builds) against the torch
build it replaces, field by field and bitwise, under Triton's interpreter (in a process of its own: see
``kernel_testing``)."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, run_under_interpreter

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import YarnScaling


@launcher_only
def test_decode_index_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def flattened(value, prefix: str = "") -> dict[str, object]:
    """Every field of an index, nested fields by their path."""
    if torch.is_tensor(value) or value is None or isinstance(value, (int, bool, list)):
        return {prefix: value}
    if isinstance(value, dict):
        items = value.items()
    else:
        items = ((name, getattr(value, name)) for name in value.__dataclass_fields__)
    return {path: leaf for key, item in items for path, leaf in flattened(item, f"{prefix}.{key}").items()}


@interpreted_only
@pytest.mark.parametrize("requests", [1, 5])
def test_kernel_built_decode_index_equals_the_torch_build(requests):
    """Requests at the first position, inside a block, at each ratio's block ends and the position after,
    short of and past a full window; some due a checkpoint (one not yet due), padded rows at row 0."""
    window, ratios, request_rows, columns = 8, (4, 16), 7, 70
    generator = torch.Generator().manual_seed(requests)
    tables = types.SimpleNamespace(
        window_table=torch.randint(1, 1000, (request_rows, columns + 1), generator=generator),
        entry_table={r: torch.randint(1, 1000, (request_rows, columns // r + 1), generator=generator) for r in ratios},
    )
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16)
    config = types.SimpleNamespace(
        sliding_window=window, csa_rate=4, rope_head_dim=8, rope_theta=10000.0, compress_rope_theta=160000.0, yarn=yarn
    )
    graph_index = batched.DecodeGraphIndex(8, tables, config, "cpu")
    checkpoint = types.SimpleNamespace
    graph_index.stage_checkpoints(
        {3: [checkpoint(position=16, record=5), checkpoint(position=40, record=2)], 6: [checkpoint(position=4, record=1)]}
    )
    rows = torch.tensor([3, 6, 2, 5, 1, 0, 0, 4])[: requests + 2]
    seq_lens = torch.tensor([16, 4, 1, 17, 64, 1, 1, 9])[: requests + 2]
    if requests == 1:
        rows, seq_lens = torch.tensor([3]), torch.tensor([16])

    # Cloned: both builds write the same buffers.
    expected = {name: value.clone() if torch.is_tensor(value) else value
                for name, value in flattened(graph_index.build(rows, seq_lens)).items()}
    for buffer in flattened(graph_index.buffers).values():
        if torch.is_tensor(buffer):
            buffer.fill_(-7)  # what the torch build left there must not pass for the kernels' writes
    built = flattened(graph_index.build_in_kernels(rows, seq_lens))

    assert built.keys() == expected.keys()
    for name, value in expected.items():
        if torch.is_tensor(value):
            assert built[name].dtype == value.dtype and torch.equal(built[name], value), name
        else:
            assert built[name] == value, name
