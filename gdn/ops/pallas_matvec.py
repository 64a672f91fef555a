"""The product of a few rows and a weight matrix, y [M, N] = x [M, K] w [K, N], as one Pallas (Triton) kernel.

Shapes: M rows (at most ROWS), K input features, N outputs; BN outputs and BK inputs a block, S the slices of K
that programs split between them.

Why: at batch 1 to 8 a decode step's matmuls only read their weights, and on the H200 XLA's choices read them
at 62% of the card's bandwidth (cuBLAS and Triton GEMMs of 10-15 us a layer for 23-46 MB;
results/benchmarks/h200_2026-12-03/decode_profile.txt). This kernel is written for that case: one program per
(block of BN outputs, slice of K), each streaming its [K / S, BN] block of w through Triton's software
pipeline in steps of BK rows and multiplying it with x's rows (padded with zero rows to ROWS, since Triton's
dots need 16) on the tensor cores, float32 accumulation. Where the outputs alone would give fewer than
MIN_PROGRAMS programs, K is split in S slices whose float32 partial sums XLA adds after the kernel.

Only 16-bit weights (bfloat16, float16): a float32 matmul stays XLA's, whose precision it keeps. `plan` says
which shapes the kernel takes (BN and BK powers of two of at least 16 that divide N and K); the caller falls
back to XLA's dot for the others (`gdn.layers.fused.FusedLinear.matmul`, under MATVEC_KERNEL).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops.pallas_common import default_interpret

# The kernel in a lean (`for_decoding`) model's matmuls of at most ROWS rows: True, False, or None = where the
# Pallas kernels compile (a GPU backend). Read when the step is traced. Off: on the H200 (`bench_decode --switch
# ops.pallas_matvec.MATVEC_KERNEL=off,auto`, results/benchmarks/h200_2026-12-03/decode_pad_matvec.txt) it took a
# batch-1 decode step from 0.859 to 0.828 ms and a batch-8 one from 0.790 to 0.827.
MATVEC_KERNEL: Optional[bool] = False
ROWS = 16  # x's rows as the kernel sees them (Triton's dots need 16); callers with more rows use XLA
BLOCK_N = 64  # the most outputs a program (a power of two)
BLOCK_K = 128  # the most input rows of w a step of a program's loop (a power of two)
MIN_PROGRAMS = 128  # split K until the grid has at least this many programs (the H200 has 132 SMs) ...
MAX_SPLIT = 8  # ... into at most this many slices
NUM_WARPS = 4
NUM_STAGES = 4
DTYPES = (jnp.bfloat16, jnp.float16)


def enabled() -> bool:
  """Whether MATVEC_KERNEL asks for the kernel now."""
  return not default_interpret() if MATVEC_KERNEL is None else bool(MATVEC_KERNEL)


def _block(n: int, most: int) -> int:
  """The largest power of two of at most `most` and at least 16 that divides n; 0 if none does."""
  b = most
  while b >= 16:
    if n % b == 0:
      return b
    b //= 2
  return 0


def plan(M: int, K: int, N: int, dtype, block_n: Optional[int] = None, block_k: Optional[int] = None):
  """(BN, BK, S) for x [M, K] and w [K, N] of `dtype`, or None where the kernel does not take them."""
  if not 1 <= M <= ROWS or jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return None
  BN, BK = _block(N, block_n or BLOCK_N), _block(K, block_k or BLOCK_K)
  if not BN or not BK:
    return None
  S = 1
  while N // BN * S < MIN_PROGRAMS and S < MAX_SPLIT and K % (BK * S * 2) == 0:
    S *= 2
  return BN, BK, S


def _kernel(x_ref, w_ref, o_ref, *, steps: int, BK: int):
  s = pl.program_id(1)

  def step(i, acc):
    k0 = pl.multiple_of((s * steps + i) * BK, BK)
    return acc + jnp.dot(x_ref[:, pl.ds(k0, BK)], w_ref[pl.ds(k0, BK), :], preferred_element_type=jnp.float32)

  o_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))


def matvec(x, w, *, out_dtype=None, interpret: Optional[bool] = None, block_n: Optional[int] = None,
           block_k: Optional[int] = None):
  """x [M, K] @ w [K, N] -> [M, N] in `out_dtype` (default x's), float32 accumulation. x and w of one 16-bit
  dtype, at a shape `plan` takes (else ValueError). interpret: Pallas' interpreter (None: where the default
  backend is not a GPU)."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"matvec: x must be [M, K] and w [K, N], got x {x.shape} and w {w.shape}")
  if x.dtype != w.dtype:
    raise ValueError(f"matvec: x and w must share a dtype, got {x.dtype} and {w.dtype}")
  (M, K), N = x.shape, w.shape[1]
  p = plan(M, K, N, w.dtype, block_n, block_k)
  if p is None:
    raise ValueError(f"matvec does not take x {x.shape} and w {w.shape} of {w.dtype}: check `plan` first")
  BN, BK, S = p
  interpret = default_interpret() if interpret is None else interpret
  xp = jnp.pad(x, ((0, ROWS - M), (0, 0)))
  out = pl.pallas_call(
      functools.partial(_kernel, steps=K // (BK * S), BK=BK), grid=(N // BN, S),
      in_specs=[pl.BlockSpec((ROWS, K), lambda n, s: (0, 0)), pl.BlockSpec((K, BN), lambda n, s: (0, n))],
      out_specs=pl.BlockSpec((None, ROWS, BN), lambda n, s: (s, 0, n)),
      out_shape=jax.ShapeDtypeStruct((S, ROWS, N), jnp.float32), interpret=interpret, name="gdn_matvec",
      compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES))(xp, w)
  y = out[0] if S == 1 else out.sum(0)
  return y[:M].astype(out_dtype or x.dtype)
