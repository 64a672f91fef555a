"""Conventions every Pallas (Triton) kernel of `gdn.ops` shares: block sizes, where kernels run, dot precision."""

from __future__ import annotations

import jax


def pow2(n: int, least: int = 16) -> int:
  """Triton needs power-of-two block shapes, and at least 16 along every dot dimension."""
  return max(least, 1 << max(0, n - 1).bit_length())


def default_interpret() -> bool:
  """Compiled Triton kernels on a GPU backend; Pallas' interpreter elsewhere (CPU CI runs the same kernels)."""
  return jax.default_backend() != "gpu"


def kernel_precision(prec, interpret: bool):
  """The dot precision inside the kernels. Compiled, a float32 caller's HIGHEST becomes 3xTF32 (three TF32
  tensor-core products, float32 accumulation, about float32 accuracy): Triton lowers HIGHEST to IEEE float32
  dots without tensor cores, which spill heavily at K = 128. DEFAULT (bfloat16 callers) is one TF32 product
  on float32 operands, as XLA does it. The interpreter keeps `prec`: XLA:CPU has no TF32 algorithms."""
  if not interpret and prec == jax.lax.Precision.HIGHEST:
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return prec
