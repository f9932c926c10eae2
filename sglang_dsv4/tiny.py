"""The embedded default: a tiny DeepSeek-V4 trained on agent text, and a builder of random ones.

The package ships a trained tiny checkpoint (:func:`shipped_checkpoint`, ``sglang_dsv4/checkpoints/tiny``,
written by ``benchmarks/train_tiny.py``): what ``dsv4 demo`` serves and ``dsv4 generate`` runs by default.
``python -m sglang_dsv4.tiny OUT_DIR`` writes, deterministically and in a second or two, a checkpoint of the
same shape with random weights (what the server tests run on, and any config they need):

* ``config.json`` in the release (hub) style, keeping every V4 feature at toy size:
  window-only, ratio-4 and ratio-128 layers, hash-routed and gated MoE layers, mHC with
  4 streams and 20 Sinkhorn iterations, 32 indexer heads, a swiglu limit that clamps;
* ``model.safetensors`` with release tensor names and random weights, including
  randomised ``tid2eid``, attention sinks, gate biases and mHC scales (a zero or constant
  there would leave the feature untested); the output head is scaled so next-token
  distributions are peaked and greedy comparisons between implementations are meaningful;
  the multi-token-prediction layer ``mtp.0.*`` (``num_nextn_predict_layers: 1``) for every config;
* the shipped checkpoint's tokenizer: a byte-level BPE trained on the same agent text, with the chat
  template of :mod:`sglang_dsv4.chat_template` (DeepSeek-V4's format: tools, tool calls, tool results).

:func:`build_quantized_checkpoint` writes one in the release's quantized format instead (FP8 dense
projections with 128 x 128 block scales, FP4 routed experts with a power-of-two scale per 32 inputs,
``quantization_config`` in ``config.json``; :data:`QUANTIZED_TINY_CONFIG` has every quantized side a
multiple of 128, so no block is partial), and :func:`dequantized_twin` the same model with every weight
dequantized to float32: the oracle a quantized model's outputs are compared with.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .chat_template import BOS, CHAT_TEMPLATE, EOS, SPECIAL_TOKENS
from .config import parse_config
from .model.block_formats import quantize_fp4, quantize_fp8
from .model.loader import dequantize, release_state_dict, scale_stem
from .model.network import DeepseekV4
from .model.weight_layout import Format, checkpoint_tensors

VOCAB_SIZE = 1024
SHIPPED = Path(__file__).parent / "checkpoints" / "tiny"

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "float32",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4],
    "num_hash_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 32,
    "index_topk": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# DeepSeek's release quantization_config (V4-Flash / V4-Pro): FP8 E4M3 dense weights in 128x128 blocks,
# power-of-two (UE8M0) scales, activations quantized per use.
RELEASE_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# TINY_CONFIG with every side of a quantized weight a multiple of 128 (whole FP8 blocks), still small
# enough that a CPU server starts in seconds.
QUANTIZED_TINY_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 128,
    "head_dim": 128,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "moe_intermediate_size": 256,  # whole FP8 blocks of the shared expert at --tp 2
    "quantization_config": RELEASE_QUANTIZATION,
}

# Standard deviation of the output head relative to 1/sqrt(hidden): large enough that the
# top-1 logit stands well clear of the second on most steps.
HEAD_GAIN = 6.0


def build_checkpoint(out_dir: str | Path, config: dict[str, Any] | None = None, *, seed: int = 0) -> Path:
    """Write a tiny checkpoint (config, weights, tokenizer) to ``out_dir``; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**(TINY_CONFIG if config is None else config), "num_nextn_predict_layers": 1}
    model = random_model(raw, seed=seed)
    save_file(release_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    checkpoint_tokenizer(raw["vocab_size"]).save_pretrained(out)
    return out


def build_quantized_checkpoint(out_dir: str | Path, config: dict[str, Any] | None = None, *, seed: int = 0) -> Path:
    """Write a random checkpoint in the release's quantized format to ``out_dir``; return it.

    The weights the release stores as FP8 or FP4 (:func:`~.model.weight_layout.checkpoint_tensors`
    with ``quantized=True``) are written quantized under their release names, each with its
    ``.scale``; the rest as :func:`build_checkpoint` writes them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**(QUANTIZED_TINY_CONFIG if config is None else config), "num_nextn_predict_layers": 1}
    tensors = release_state_dict(random_model(raw, seed=seed))
    quantize = {Format.FP8: quantize_fp8, Format.FP4: quantize_fp4}
    for spec in checkpoint_tensors(parse_config(raw), quantized=True):
        if spec.format in quantize:
            stem = spec.name.removesuffix(".weight")
            tensors[spec.name], tensors[f"{stem}.scale"] = quantize[spec.format](tensors[spec.name])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    checkpoint_tokenizer(raw["vocab_size"]).save_pretrained(out)
    return out


def dequantized_twin(quantized_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint at ``quantized_dir`` with every quantized weight dequantized to float32 (exactly:
    the scales are powers of two) and no ``quantization_config``, to ``out_dir``; return it."""
    source, out = Path(quantized_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    for name in [name for name in tensors if scale_stem(name) is not None]:
        stem = scale_stem(name)
        tensors[f"{stem}.weight"] = dequantize(tensors[f"{stem}.weight"], tensors.pop(name), stem)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    checkpoint_tokenizer(raw["vocab_size"]).save_pretrained(out)
    return out


def shipped_checkpoint() -> Path:
    """The trained tiny checkpoint inside the package (config, release-named weights, tokenizer)."""
    if not (SHIPPED / "model.safetensors").is_file():
        raise FileNotFoundError(f"no trained tiny checkpoint at {SHIPPED}: run benchmarks/train_tiny.py")
    return SHIPPED


def random_model(raw_config: dict[str, Any], *, seed: int) -> DeepseekV4:
    """The network with deterministic random weights shaped to exercise every feature."""
    config = parse_config(raw_config)
    model = DeepseekV4(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            param.copy_(_random_tensor(name, param, config.n_routed_experts, generator))
    return model.eval()


def _random_tensor(name: str, like: torch.Tensor, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    shape = like.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        rows = [torch.randperm(num_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows)
    if name.endswith("norm.weight"):
        return 1 + normal(0.1)
    if name.startswith("hc_head") or ".hc_" in name:
        if leaf == "fn":
            return normal(0.5 / math.sqrt(shape[1]))
        if leaf == "base":
            return normal(0.5)
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("attn_sink", "ape"):
        return normal(1.0 if leaf == "attn_sink" else 0.5)
    if name.endswith("gate.bias"):
        return normal(0.2)
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":
        return normal(HEAD_GAIN / math.sqrt(shape[1]))
    return normal(1 / math.sqrt(shape[-1]))


def shipped_tokenizer():
    """The shipped checkpoint's tokenizer (``transformers.PreTrainedTokenizerFast``) with the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shipped_checkpoint())
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def checkpoint_tokenizer(vocab_size: int):
    """A tokenizer of ``vocab_size`` tokens for a random checkpoint: the shipped one at its own size; a
    smaller one trained (deterministically) on the shipped vocabulary's own token strings."""
    shipped = shipped_tokenizer()
    if vocab_size == len(shipped):
        return shipped
    if vocab_size > len(shipped):
        raise ValueError(
            f"vocab_size {vocab_size}: random checkpoints take at most the shipped tokenizer's {len(shipped)}"
        )
    return train_tokenizer([shipped.decode([token]) for token in range(len(shipped))], vocab_size)


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on ``texts``, V4's chat special tokens first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"trained vocabulary has {tokenizer.get_vocab_size()} tokens, {vocab_size} wanted")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_dsv4.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_checkpoint(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
