"""The network's projections on SGLang's parallel layers, split over one of SGLang's groups.

The attention's projections are split over the attention-TP group (``attn_tp``: the whole TP
group without attention DP, ``tp / attn_dp_size`` ranks with it), the rest over the TP group
(``tp``). Each layer is SGLang's own (its quantization method, its weight loader taking the release
tensor and this rank's shard of it); the subclasses here only return the output tensor
alone, as :class:`~.linears.Layers` promises, instead of SGLang's ``(output, bias)``.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.runtime_context import get_parallel
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from torch import nn


class _Replicated(ReplicatedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class _Column(ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class _Row(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class SGLangLayers:
    """:class:`~.linears.Layers` over SGLang's group ``parallel_group`` (``"tp"`` or ``"attn_tp"``);
    ``row`` layers leave their sums to the residual."""

    def __init__(self, quant_config=None, parallel_group: str = "tp"):
        self.quant_config = quant_config
        self.parallel_group = parallel_group
        parallel = get_parallel()
        self.tp_size = getattr(parallel, f"{parallel_group}_size")
        self.tp_rank = getattr(parallel, f"{parallel_group}_rank")

    def replicated(self, inputs: int, outputs: int, name: str) -> nn.Module:
        return _Replicated(inputs, outputs, bias=False, quant_config=self.quant_config, prefix=name)

    def column(self, inputs: int, outputs: int, name: str, quantized: bool = True) -> nn.Module:
        quant_config = self.quant_config if quantized else None
        return _Column(
            inputs, outputs, bias=False, quant_config=quant_config, prefix=name, parallel_group=self.parallel_group
        )

    def row(self, inputs: int, outputs: int, name: str) -> nn.Module:
        return _Row(
            inputs,
            outputs,
            bias=False,
            reduce_results=False,
            quant_config=self.quant_config,
            prefix=name,
            parallel_group=self.parallel_group,
        )

    def sharded(self, size: int) -> nn.Parameter:
        """This rank's ``size / tp`` rows, loaded from the whole checkpoint tensor."""
        param = nn.Parameter(torch.zeros(size // self.tp_size), requires_grad=False)
        rank = self.tp_rank

        def load(param: nn.Parameter, whole: torch.Tensor) -> None:
            local = param.shape[0]
            param.data.copy_(whole.narrow(0, rank * local, local))

        param.weight_loader = load
        return param

    def embedding(self, vocab: int, hidden: int, name: str) -> nn.Module:
        """Vocabulary rows over the TP group; whole under attention DP, where each DP rank embeds its own tokens."""
        return VocabParallelEmbedding(vocab, hidden, prefix=name, enable_tp=not is_dp_attention_enabled())

    def head(self, vocab: int, hidden: int, name: str) -> nn.Module:
        """Vocabulary rows over the TP group (the attention-TP group with SGLang's ``--enable-dp-lm-head``)."""
        return ParallelLMHead(vocab, hidden, prefix=name, use_attn_tp_group=get_parallel().enable_dp_lm_head)
