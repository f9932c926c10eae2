"""Triton kernels for the GPU and their batched torch implementations: the ground floor.

Tensors in, tensors out; nothing here imports from the network (``model/``) or SGLang.
:mod:`.dispatch` is the one place that chooses a kernel over its torch implementation.
"""
