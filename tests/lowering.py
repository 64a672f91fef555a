"""Lowering a jitted function for CUDA without a GPU, for the tests that check what its Triton kernels lower to."""

import pytest


def cuda_hlo(fn, *args) -> str:
  """The HLO text of the jitted `fn` at `args` lowered for CUDA; the test is skipped where this jax lowers Triton
  kernels only with a GPU present (jax >= 0.11)."""
  try:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except RuntimeError as e:
    if "No supported GPU devices" not in str(e):
      raise
    pytest.skip(f"this jax cannot lower Triton kernels without a GPU: {e}")
