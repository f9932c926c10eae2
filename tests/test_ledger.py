"""The KV ledger: published reference figures, and our layout equal to what the pool allocates."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.config import ConfigError, named_config
from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool.ledger import (
    DEFAULT_MEM_FRACTION_STATIC,
    KV_DTYPES,
    MTP_PART,
    KVLedger,
    RankLedger,
    resolve_config,
)
from sglang_dsv4.model.weight_layout import Parallelism, checkpoint_tensors

MiB, GiB = 2**20, 2**30

# (B/token, MiB per request, GiB at 128K, GiB at 1M), to the precision DeepSeek published.
PUBLISHED = {
    "flash": ("3,850", "14.7", "0.484", "3.77"),
    "pro": ("5,511", "22.2", "0.69", "5.40"),
}


def reference_column(output: str) -> dict[str, str]:
    """Row label -> the reference layout's cell of a printed ledger table."""
    cells = {}
    for line in output.splitlines():
        columns = re.split(r"\s{2,}", line.strip())
        if len(columns) == 3:
            cells[columns[0]] = columns[1]
    return cells


def to_published_precision(value: float, published: str) -> str:
    decimals = len(published.partition(".")[2])
    return f"{value:,.{decimals}f}"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_reference_layout_reproduces_the_published_figures(name):
    reference = KVLedger(named_config(name)).reference
    assert reference.entry_bytes == 584 and reference.indexer_key_bytes == 132
    figures = (
        reference.bytes_per_token,
        reference.running_bytes_per_request / MiB,
        reference.bytes_for(131072) / GiB,
        reference.bytes_for(1048576) / GiB,
    )
    assert tuple(map(to_published_precision, figures, PUBLISHED[name])) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dsv4_ledger_prints_the_published_figures(name, capsys):
    dsv4(["ledger", "--config", name])
    cells = reference_column(capsys.readouterr().out)
    rows = ("bytes per token", "fixed bytes per request", "total at 131,072 tokens", "total at 1,048,576 tokens")
    printed = [float(cells[row].split()[0].replace(",", "")) for row in rows]
    assert tuple(map(to_published_precision, printed, PUBLISHED[name])) == PUBLISHED[name]
    assert [cells[row].split()[1] for row in rows] == ["B", "MiB", "GiB", "GiB"]


def test_dsv4_ledger_totals_the_requested_contexts_in_the_requested_dtype(capsys):
    dsv4(["ledger", "--config", "flash", "--kv-dtype", "fp8", "--context", "4096"])
    output = capsys.readouterr().out
    assert "ours (float8_e4m3fn)" in output
    assert [line.split("  ")[0] for line in output.splitlines() if line.startswith("total")] == [
        "total at 4,096 tokens"
    ]


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_with_fp8_kv_our_rows_are_the_reference_rows_with_keys_padded_to_144_bytes(name):
    ledger = KVLedger(named_config(name), torch.float8_e4m3fn)
    reference, ours, config = ledger.reference, ledger.ours, ledger.config
    key_layers = sum(config.layer_kind(layer) == "csa" for layer in range(config.num_layers))
    padding_per_token = key_layers * (144 - 132) / config.csa_rate
    # V4-Flash 3,850 + 63 B, V4-Pro 5,511 + 90 B
    assert ours.bytes_per_token == reference.bytes_per_token + padding_per_token
    assert ours.window_slot_bytes == ledger.config.num_layers * reference.entry_bytes
    assert KVLedger(named_config(name), torch.bfloat16).ours.bytes_per_token > 1.7 * ours.bytes_per_token


@pytest.mark.parametrize(
    ("name", "kv_dtype", "verify_tokens"),
    [("flash", "fp8", 0), ("flash", "bf16", 0), ("pro", "bf16", 0), ("pro", "fp8", 0), ("flash", "fp8", 4)],
)
def test_our_layout_is_what_the_pool_allocates(name, kv_dtype, verify_tokens):
    config, dtype = named_config(name), KV_DTYPES[kv_dtype]
    ours = KVLedger(config, dtype, verify_tokens).ours
    # Row 0 of every buffer and request row 0 are padding.
    padding = ours.padding_bytes + ours.bytes_per_request
    tokens = 2 * config.hca_rate  # a whole number of blocks at every ratio
    # Two pools differing in tokens and in requests pin both figures (the system has one solution).
    for pool_tokens, requests in [(tokens, 1), (2 * tokens, 2)]:
        pool = V4KVPool(
            pool_tokens, 1, config, dtype, requests, pool_tokens, device="cpu", verify_tokens=verify_tokens
        )
        assert (
            pool.storage.allocated_bytes
            == ours.bytes_per_token * pool_tokens + ours.bytes_per_request * requests + padding
        )


def test_our_fixed_bytes_per_request_are_a_fraction_of_the_reference():
    ledger = KVLedger(named_config("flash"), torch.bfloat16)
    assert ledger.fixed_ratio == ledger.ours.running_bytes_per_request / ledger.reference.running_bytes_per_request
    assert ledger.fixed_ratio < 0.5  # online compressor state instead of raw rows


@pytest.mark.parametrize(
    ("name", "layers", "window_only", "ratio_4", "ratio_128", "hidden", "heads", "experts", "top_k"),
    [
        ("flash", 43, 2, 21, 20, 4096, 64, 256, 512),
        ("pro", 61, 0, 30, 31, 7168, 128, 384, 1024),
    ],
)
def test_shipped_configs_have_the_published_layer_counts(
    name, layers, window_only, ratio_4, ratio_128, hidden, heads, experts, top_k
):
    config = named_config(name)
    kinds = [config.layer_kind(layer) for layer in range(config.num_layers)]
    assert (config.num_layers, kinds.count("window"), kinds.count("csa"), kinds.count("hca")) == (
        layers,
        window_only,
        ratio_4,
        ratio_128,
    )
    assert (config.hidden_size, config.num_heads, config.n_routed_experts, config.index_topk) == (
        hidden,
        heads,
        experts,
        top_k,
    )


def test_config_resolves_from_a_checkpoint_directory_or_a_config_file(tmp_path):
    from importlib import resources

    raw = json.loads(resources.files("sglang_dsv4.configs").joinpath("pro.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_config(str(tmp_path)) == resolve_config(str(tmp_path / "config.json")) == named_config("pro")


def test_unknown_config_is_refused_naming_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"--config '.*missing': no such file or directory.*\['flash', 'pro'\]"):
        resolve_config(str(tmp_path / "missing"))


def per_gpu_cells(output: str, heading: str) -> dict[str, str]:
    """Row label -> figure of the printed per-GPU table that starts with ``heading``."""
    table = output[output.index(heading) :].splitlines()[1:]
    return dict(re.split(r"\s{2,}", line.strip()) for line in table if re.search(r"\S\s{2,}\S", line))


def test_dsv4_ledger_says_the_tp_group_shares_its_sessions_without_attention_dp(capsys):
    dsv4(["ledger", "--config", "flash", "--tp", "8", "--ep", "8", "--context", "27000"])
    output = capsys.readouterr().out
    cells = per_gpu_cells(output, "per GPU: tp 8, attention DP 1 (attention-TP 8), ep 8 (32 expert slots of 256")
    assert cells["weights on one GPU"].endswith("GiB") and float(cells["weights on one GPU"].split()[0]) < 25
    pooled = int(cells["27,000-token sessions in one GPU's pools"].replace(",", ""))
    assert pooled > 100
    # Every GPU of the TP group holds the same sessions: a node of 8 holds one GPU's pools' worth.
    assert float(cells["distinct per GPU (/ attention-TP 8)"]) == pytest.approx(pooled / 8, abs=0.05)
    assert int(cells["distinct per node of 8 GPUs"].replace(",", "")) == pooled
    assert "the 8 GPUs of the TP group share their sessions" in output


def test_dsv4_ledger_counts_each_attention_dp_ranks_own_sessions(capsys):
    dsv4(["ledger", "--config", "flash", "--tp", "8", "--attn-dp-size", "8", "--ep", "8", "--context", "27000"])
    output = capsys.readouterr().out
    cells = per_gpu_cells(output, "per GPU: tp 8, attention DP 8 (attention-TP 1), ep 8")
    pooled = int(cells["27,000-token sessions in one GPU's pools"].replace(",", ""))
    assert cells["distinct per GPU (/ attention-TP 1)"] == f"{pooled:,}"
    assert int(cells["distinct per node of 8 GPUs"].replace(",", "")) == 8 * pooled
    assert "each attention-TP group of 1 GPU(s) holds its own sessions" in output


def test_attention_dp_ranks_hold_whole_attention_and_embedding_and_a_tp_share_of_the_rest():
    config = named_config("flash")
    one_gpu = RankLedger(config, Parallelism(), quantized=True).weight_bytes()
    tp_only = RankLedger(config, Parallelism(tp=8, ep=8), quantized=True).weight_bytes()
    dp = RankLedger(config, Parallelism(tp=8, ep=8, attn_dp=8), quantized=True).weight_bytes()
    assert dp["attention"] == one_gpu["attention"] > tp_only["attention"]
    assert dp["embedding"] == one_gpu["embedding"]
    for part in ("head", "routed experts", "shared expert, routers, norms, mHC"):
        assert dp[part] == tp_only[part], part
    # Attention-TP 2 (four DP groups): between the two.
    four_groups = RankLedger(config, Parallelism(tp=8, ep=8, attn_dp=4), quantized=True).weight_bytes()
    assert tp_only["attention"] < four_groups["attention"] < dp["attention"]


def test_a_layout_whose_weights_exceed_the_static_share_is_reported_with_the_attention_tp_sizes_that_fit(capsys):
    pro_dp8 = RankLedger(named_config("pro"), Parallelism(tp=8, ep=8, attn_dp=8), quantized=True)
    assert not pro_dp8.fits(DEFAULT_MEM_FRACTION_STATIC)
    fitting = pro_dp8.fitting_attention_tp_sizes(DEFAULT_MEM_FRACTION_STATIC)
    assert fitting and 1 not in fitting and 8 in fitting
    for attention_tp in fitting:
        layout = Parallelism(tp=8, ep=8, attn_dp=8 // attention_tp)
        assert RankLedger(named_config("pro"), layout, quantized=True).fits(DEFAULT_MEM_FRACTION_STATIC)
    dsv4(["ledger", "--config", "pro", "--tp", "8", "--attn-dp-size", "8", "--ep", "8", "--context", "27000"])
    output = capsys.readouterr().out
    cells = per_gpu_cells(output, "per GPU: tp 8, attention DP 8")
    assert cells["left for the KV pools"] == "none: does not fit"
    assert cells["27,000-token sessions in one GPU's pools"] == "0"
    sizes = ", ".join(f"{size} (--attn-dp-size {8 // size})" for size in fitting)
    assert re.search(r"does not fit: the weights \(.* GiB\) exceed the static share \(119 GiB\); "
                     rf"attention-TP sizes that fit: {re.escape(sizes)}$", output.strip())  # fmt: skip


def test_dsv4_ledger_refuses_an_attention_dp_size_that_does_not_divide_tp():
    with pytest.raises(SystemExit, match=r"--attn-dp-size \(3\) must divide --tp \(8\)"):
        dsv4(["ledger", "--config", "flash", "--tp", "8", "--attn-dp-size", "3"])


def test_dsv4_ledger_refuses_an_expert_parallel_size_that_does_not_divide_tp():
    with pytest.raises(SystemExit, match=r"--ep-size \(3\) must divide --tp \(8\)"):
        dsv4(["ledger", "--config", "flash", "--tp", "8", "--ep", "3"])


def test_weight_ledger_counts_the_mtp_layer_on_its_own_line():
    config = named_config("flash")
    parallel = Parallelism(tp=8, ep=8)
    with_mtp = RankLedger(config, parallel, quantized=True).weight_bytes()
    without = RankLedger(config.without_mtp(), parallel, quantized=True).weight_bytes()
    mtp_specs = [spec for spec in checkpoint_tensors(config, quantized=True) if spec.name.startswith("mtp.")]
    dense = sum(spec.bytes_on_rank(parallel, 2) for spec in mtp_specs if not spec.expert)
    experts = sum(spec.bytes_on_rank(parallel, 2) for spec in mtp_specs if spec.expert) / 8  # 256 experts over 8 ranks
    assert with_mtp[MTP_PART] == round(dense + experts) > 0 and without[MTP_PART] == 0
    assert {name: size for name, size in with_mtp.items() if name != MTP_PART} == {
        name: size for name, size in without.items() if name != MTP_PART
    }


def test_dsv4_ledger_under_speculation_counts_the_rollback_records_and_the_mtp_layers_kv(capsys):
    config, fp8 = named_config("flash"), KV_DTYPES["fp8"]
    printed = {}
    for draft_tokens in ("0", "4"):
        dsv4(["ledger", "--config", "flash", "--kv-dtype", "fp8", "--context", "27000", "--tp", "8", "--ep", "8",
              "--speculative-num-draft-tokens", draft_tokens])  # fmt: skip
        output = capsys.readouterr().out
        printed[draft_tokens] = reference_column(output) | per_gpu_cells(output, "per GPU:")
    plain, speculating = KVLedger(config, fp8).ours, KVLedger(config, fp8, 4).ours
    assert "of it rollback records (4)" in speculating_rows(printed["4"]) and not speculating_rows(printed["0"])
    assert speculating.state_bytes_per_request - plain.state_bytes_per_request == 4 * plain.record_bytes
    assert speculating.window_slot_bytes == (config.num_layers + 1) * plain.formats.entries.row_bytes
    sessions = [int(cells["27,000-token sessions in one GPU's pools"].replace(",", "")) for cells in printed.values()]
    assert sessions[1] < sessions[0]


def speculating_rows(cells: dict[str, str]) -> list[str]:
    return [label for label in cells if "rollback" in label]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_a_session_on_the_host_tier_is_the_rows_the_tier_keeps_for_it(kv_dtype):
    # The oracle: the rows a host tier writes back for a session (every block's entries and indexer keys, and one
    # checkpoint: a window row in every layer for each of its slots, and a state record), built in their formats.
    config, context = named_config("flash"), 27648
    layout = RankLedger(config, Parallelism(8, 8, 8), True, kv_dtype=KV_DTYPES[kv_dtype]).kv
    entries = sum(layout.format_of(b).encode(torch.zeros(context // b.ratio, b.dim)).nbytes
                  for b in layout.compressed_buffers())  # fmt: skip
    window_row = layout.formats.entries.encode(torch.zeros(config.sliding_window, config.head_dim)).nbytes
    window = len(layout.layers) * window_row
    record = sum(b.floats for b in layout.state_buffers()) * 4
    rank = RankLedger(config, Parallelism(8, 8, 8), True, kv_dtype=KV_DTYPES[kv_dtype])
    assert rank.host_session_bytes(context) == entries + window + record


def test_dsv4_ledger_counts_the_sessions_a_host_tier_keeps(capsys):
    dsv4(["ledger", "--config", "flash", "--tp", "8", "--attn-dp-size", "8", "--ep", "8", "--context", "27648",
          "--enable-hierarchical-cache", "--hicache-size", "100"])  # fmt: skip
    cells = per_gpu_cells(capsys.readouterr().out, "per GPU: tp 8, attention DP 8 (attention-TP 1), ep 8")
    rank = RankLedger(named_config("flash"), Parallelism(8, 8, 8), True)
    host = cells["kept once evicted, in a host tier of 93.1 GiB"]
    assert int(host.replace(",", "")) == 100 * 10**9 // rank.host_session_bytes(27648)
