"""Attention backends SGLang calls for V4, one interface: ``dsv4_batched`` (the default; its SGLang-free core,
:mod:`.batched`, runs Triton kernels on CUDA and batched torch elsewhere, :mod:`sglang_dsv4.kernels.dispatch`
choosing) and ``dsv4_torch``, the per-request reference it is tested against."""
