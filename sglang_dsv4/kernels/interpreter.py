"""What the kernels of this package need to run under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter keeps bfloat16 tensors as raw uint16 and multiplies those integers in
``tl.dot``; upcasting the operands to float32 first gives the product a GPU computes
(bf16 operands, float32 accumulation) exactly. Kernels take the choice as a constexpr,
so compiled code is unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


INTERPRETED: bool = not isinstance(_probe, triton.runtime.JITFunction)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with a float32 accumulator; ``UPCAST`` under the interpreter."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
