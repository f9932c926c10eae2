"""Attention backends SGLang calls for V4: the torch reference (Triton kernels later, same interface)."""
