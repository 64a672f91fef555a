"""The short causal depthwise convolution and its SiLU as Pallas kernels, forward and backward
(`gdn.layers.conv.CONV_KERNEL`; compiled on GPUs, interpreted elsewhere).

Shapes: B batch, T time, C channels, W taps; BT x BC the block of (time, channel) one program owns.

    y[u] = activation(sum_j keep[u, j] w[j] xp[u + j] + b),   xp = [state (W-1 rows); x]

The forward kernel, grid (B, T / BT, C / BC), reads tap j's rows u - (W-1-j) of x straight from the input (a
shifted window of the same [T, BC] column block; L2 serves the overlap) and the block's first rows from `head`
= [zeros; state; x[:BT]] (2 BT rows a batch, built in XLA), so neither [state; x] nor any shifted copy is written
to memory: x is read once and y written once, the traffic XLA's taps use several times (docs/benchmarks.md).
Products and sums are float32 (float64 for float64 inputs); y is written in x's dtype. The taps are loaded one at
a time (the backward loads them again for the weight's sums) and the warps follow the block, so that nothing
spills (`experiments/kernel_resources.py --conv-channels`).

Backward, two kernels: (1) the taps again, the SiLU's derivative, dpre = dy * silu'(pre) written once in x's
dtype (as `conv._conv_bwd` rounds it), and each block's weight-gradient partial sums sum_u keep[u, j] xp[u + j]
dpre[u] [W, BC] in float32 (XLA adds them up over batch and time); (2) dx[t] = sum_j w[j] keep[t + s_j, j]
dpre[t + s_j] with s_j = W-1-j, reading the last block's rows beyond T from `tail` = [dpre[T-BT:]; zeros]. The
W-1 state rows' cotangent (the previous slice's inputs under context parallelism) and the bias' are small sums
in XLA.

Triton constraints the kernels keep: power-of-two blocks of at least 16, dynamic row windows of refs
(`pl.ds`), no slicing of loaded values; `supported` says which shapes take the kernels (T and C multiples of a
block), the rest stay with XLA's taps.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops.pallas_common import default_interpret

BLOCKS_T = (64, 32, 16)
BLOCKS_C = (128, 64, 32, 16)
# One block size to use in place of the first of BLOCKS_T / BLOCKS_C that divides the shape (0: that choice), e.g.
# for a sweep (`experiments/bench_conv.py --switch layers.conv_kernel.BLOCK_T=16,32,64`). Read at the call; a
# shape the size does not divide keeps XLA's taps.
BLOCK_T = 0
BLOCK_C = 0
# Warps per program: one per 1,024 elements of the block, at most 8. At [64, 128] blocks, offline for sm_90
# (Triton 3.9, ptxas -v, bfloat16, (8, 8192, 6144); `gdn.bench.kernel_resources`) 8 warps need 99-121 registers a
# thread and spill nothing, where 4 warps need 255 and spill 92-96 bytes in the forward and dx kernels.
ELEMENTS_PER_WARP = 1024


def supported(T: int, C: int, W: int) -> Optional[tuple]:
  """(BT, BC), the blocks for a [B, T, C] input and W taps, or None where the kernels do not apply."""
  bt = next((b for b in ((BLOCK_T,) if BLOCK_T else BLOCKS_T) if T % b == 0 and b >= W), None)
  bc = next((b for b in ((BLOCK_C,) if BLOCK_C else BLOCKS_C) if C % b == 0), None)
  return None if bt is None or bc is None or W < 1 else (bt, bc)


def _window(x_ref, edge_ref, i, at_edge, start, edge_start, BT: int):
  """Rows [start, start + BT) of the [T, BC] block x_ref, or rows [edge_start, edge_start + BT) of edge_ref where
  `at_edge` (the first or last block, whose window leaves [0, T))."""
  return jax.lax.cond(at_edge, lambda: edge_ref[pl.ds(edge_start, BT), :], lambda: x_ref[pl.ds(start, BT), :])


def _mask(keep_ref, j: int, BT: int):
  return None if keep_ref is None else (keep_ref[j, :] != 0)[:, None]


def _ct(dtype):
  """The kernels' arithmetic: float32, or float64 for float64 inputs (the oracle's tests)."""
  return jnp.promote_types(jnp.float32, dtype)


def _tap(x_ref, head_ref, keep_ref, j: int, W: int, BT: int):
  """Tap j's inputs for the block's rows [BT, BC] (in `_ct`), masked where the tap leaves the segment."""
  i = pl.program_id(1)
  s = W - 1 - j
  tap = _window(x_ref, head_ref, i, i == 0, i * BT - s, BT - s, BT).astype(_ct(x_ref.dtype))
  keep = _mask(keep_ref, j, BT)
  return tap if keep is None else jnp.where(keep, tap, 0.0)


def _pre(x_ref, head_ref, w_ref, b_ref, keep_ref, W: int, BT: int):
  """The block's pre-activation [BT, BC] (in `_ct`); the taps are loaded one at a time, so that only the sum is
  held in registers."""
  acc = None
  for j in range(W):
    term = _tap(x_ref, head_ref, keep_ref, j, W, BT) * w_ref[j, :].astype(_ct(x_ref.dtype))[None, :]
    acc = term if acc is None else acc + term
  if b_ref is not None:
    acc = acc + b_ref[0, :].astype(acc.dtype)[None, :]
  return acc


def _refs(refs, has_b: bool, has_keep: bool, n_in: int):
  ins = list(refs[:n_in])
  b_ref = ins.pop(3) if has_b else None
  keep_ref = ins.pop(3) if has_keep else None
  return ins, b_ref, keep_ref, refs[n_in:]


def _fwd_kernel(*refs, W, BT, activation, has_b, has_keep):
  (x_ref, head_ref, w_ref), b_ref, keep_ref, (y_ref,) = _refs(refs, has_b, has_keep, 3 + has_b + has_keep)
  pre = _pre(x_ref, head_ref, w_ref, b_ref, keep_ref, W, BT)
  y = pre * jax.nn.sigmoid(pre) if activation == "silu" else pre
  y_ref[...] = y.astype(y_ref.dtype)


def _bwd_pre_kernel(*refs, W, BT, activation, has_b, has_keep):
  """dpre and the weight's partial sums of one block."""
  n_in = 4 + has_b + has_keep
  ins, b_ref, keep_ref, (dpre_ref, dw_ref) = _refs(refs, has_b, has_keep, n_in)
  x_ref, head_ref, w_ref, dy_ref = ins
  pre = _pre(x_ref, head_ref, w_ref, b_ref, keep_ref, W, BT)
  dy = dy_ref[...].astype(pre.dtype)
  if activation == "silu":
    sig = jax.nn.sigmoid(pre)
    dy = dy * sig * (1.0 + pre * (1.0 - sig))
  dpre = dy.astype(dpre_ref.dtype)
  dpre_ref[...] = dpre
  d = dpre.astype(pre.dtype)
  for j in range(W):  # the taps loaded again (from cache), not kept from the sum above
    dw_ref[j, :] = jnp.sum(_tap(x_ref, head_ref, keep_ref, j, W, BT) * d, axis=0)


def _bwd_dx_kernel(*refs, W, BT, nT, has_keep):
  if has_keep:
    dpre_ref, tail_ref, w_ref, keep_ref, keep_tail_ref, dx_ref = refs
  else:
    (dpre_ref, tail_ref, w_ref, dx_ref), keep_ref, keep_tail_ref = refs, None, None
  i = pl.program_id(1)
  last = i == nT - 1
  ct = _ct(dpre_ref.dtype)
  acc = None
  for j in range(W):
    s = W - 1 - j
    d = _window(dpre_ref, tail_ref, i, last, i * BT + s, s, BT).astype(ct)
    if keep_ref is not None:
      k = jax.lax.cond(last, lambda: keep_tail_ref[j, pl.ds(s, BT)], lambda: keep_ref[j, pl.ds(i * BT + s, BT)])
      d = jnp.where((k != 0)[:, None], d, 0.0)
    term = d * w_ref[j, :].astype(ct)[None, :]
    acc = term if acc is None else acc + term
  dx_ref[...] = acc.astype(dx_ref.dtype)


def _specs(W, BT, BC):
  col = lambda rows: pl.BlockSpec((None, rows, BC), lambda b, i, j: (b, 0, j))
  block = pl.BlockSpec((None, BT, BC), lambda b, i, j: (b, i, j))
  weight = pl.BlockSpec((W, BC), lambda b, i, j: (0, j))
  bias = pl.BlockSpec((1, BC), lambda b, i, j: (0, j))
  keep_block = pl.BlockSpec((None, W, BT), lambda b, i, j: (b, 0, i))
  keep_whole = lambda cols: pl.BlockSpec((None, W, cols), lambda b, i, j: (b, 0, 0))
  return col, block, weight, bias, keep_block, keep_whole


def _head(x, state, BT: int):
  """[zeros; state; x[:, :BT]]: 2 BT rows a batch, the first block's window."""
  B, _, C = x.shape
  W1 = state.shape[1]
  return jnp.concatenate([jnp.zeros((B, BT - W1, C), x.dtype), state.astype(x.dtype), x[:, :BT]], axis=1)


def _params(interpret: bool, BT: int, BC: int):
  warps = max(1, min(8, BT * BC // ELEMENTS_PER_WARP))
  return None if interpret else pl_triton.CompilerParams(num_warps=warps, num_stages=1)


def _tap_inputs(x, state, w, b, keep8, BT: int, BC: int):
  """The arrays and block specs the taps read (`_pre`): x, its head, w, then b and keep where given."""
  T, C, W = x.shape[1], x.shape[2], w.shape[0]
  col, _, weight, bias, keep_block, _ = _specs(W, BT, BC)
  ins, specs = [x, _head(x, state, BT), w], [col(T), col(2 * BT), weight]
  if b is not None:
    ins.append(b.reshape(1, C))
    specs.append(bias)
  if keep8 is not None:
    ins.append(keep8)
    specs.append(keep_block)
  return ins, specs


def _keep8(keep):
  """keep [B, T, W] bool as int8 [B, W, T] (each tap's row a contiguous vector), or None."""
  return None if keep is None else jnp.swapaxes(keep, 1, 2).astype(jnp.int8)


def _forward(x, state, w, b, keep, activation, interpret):
  B, T, C = x.shape
  W = w.shape[0]
  BT, BC = supported(T, C, W)
  block = _specs(W, BT, BC)[1]
  ins, specs = _tap_inputs(x, state, w, b, _keep8(keep), BT, BC)
  kernel = functools.partial(_fwd_kernel, W=W, BT=BT, activation=activation, has_b=b is not None,
                             has_keep=keep is not None)
  return pl.pallas_call(kernel, grid=(B, T // BT, C // BC), in_specs=specs, out_specs=block,
                        out_shape=jax.ShapeDtypeStruct((B, T, C), x.dtype), interpret=interpret,
                        name="gdn_short_conv", compiler_params=_params(interpret, BT, BC))(*ins)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, state, w, b, keep, activation, interpret):
  return _forward(x, state, w, b, keep, activation, interpret)


def _conv_fwd(x, state, w, b, keep, activation, interpret):
  return _forward(x, state, w, b, keep, activation, interpret), (x, state, w, b, keep)


def _conv_bwd(activation, interpret, res, dy):
  x, state, w, b, keep = res
  B, T, C = x.shape
  W = w.shape[0]
  BT, BC = supported(T, C, W)
  nT = T // BT
  col, block, weight, _, _, keep_whole = _specs(W, BT, BC)
  keep8 = _keep8(keep)
  ins, specs = _tap_inputs(x, state, w, b, keep8, BT, BC)
  ins.append(dy.astype(x.dtype))
  specs.append(block)
  kernel = functools.partial(_bwd_pre_kernel, W=W, BT=BT, activation=activation, has_b=b is not None,
                             has_keep=keep is not None)
  dpre, parts = pl.pallas_call(
      kernel, grid=(B, nT, C // BC), in_specs=specs,
      out_specs=[block, pl.BlockSpec((None, None, W, BC), lambda b_, i, j: (b_, i, 0, j))],
      out_shape=[jax.ShapeDtypeStruct((B, T, C), x.dtype), jax.ShapeDtypeStruct((B, nT, W, C), _ct(x.dtype))],
      interpret=interpret, name="gdn_short_conv_bwd_pre", compiler_params=_params(interpret, BT, BC))(*ins)

  tail = jnp.concatenate([dpre[:, T - BT:], jnp.zeros((B, BT, C), dpre.dtype)], axis=1)
  ins, specs = [dpre, tail, w], [col(T), col(2 * BT), weight]
  if keep8 is not None:
    ins += [keep8, jnp.concatenate([keep8[..., T - BT:], jnp.zeros((B, W, BT), jnp.int8)], axis=-1)]
    specs += [keep_whole(T), keep_whole(2 * BT)]
  kernel = functools.partial(_bwd_dx_kernel, W=W, BT=BT, nT=nT, has_keep=keep is not None)
  dx = pl.pallas_call(kernel, grid=(B, nT, C // BC), in_specs=specs, out_specs=block,
                      out_shape=jax.ShapeDtypeStruct((B, T, C), x.dtype), interpret=interpret,
                      name="gdn_short_conv_bwd_dx", compiler_params=_params(interpret, BT, BC))(*ins)

  # The state rows p < W-1 reach outputs u = p - j >= 0 through tap j (a few rows: XLA).
  f32 = _ct(x.dtype)
  d32 = dpre.astype(f32)
  rows = []
  for p in range(W - 1):
    r = jnp.zeros((B, C), f32)
    for j in range(p + 1):
      u = p - j
      if u < T:
        term = d32[:, u] * w[j].astype(f32)
        r = r + (term if keep is None else jnp.where(keep[:, u, j, None], term, 0.0))
    rows.append(r)
  dstate = (jnp.stack(rows, axis=1) if rows else jnp.zeros((B, 0, C), f32)).astype(state.dtype)
  dw = jnp.sum(parts, axis=(0, 1)).astype(w.dtype)
  db = None if b is None else jnp.sum(d32, axis=(0, 1)).astype(b.dtype)
  dkeep = None if keep is None else np.zeros(keep.shape, jax.dtypes.float0)
  return dx, dstate, dw, db, dkeep


_conv.defvjp(_conv_fwd, _conv_bwd)


def short_conv(x, state, w, b=None, keep=None, activation=None, interpret: Optional[bool] = None):
  """activation(sum_j keep[u, j] w[j] xp[u + j] + b) with xp = [state; x], as `conv.causal_conv` on the padded
  input: x [B, T, C], state [B, W-1, C], w [W, C] and b [C] (or None) in x's dtype, keep None or bool [B, T, W]
  (tap j reaches position u). Shapes that `supported` declines are refused; `conv.ShortConv` checks first."""
  B, T, C = x.shape
  W = w.shape[0]
  if supported(T, C, W) is None:
    raise ValueError(f"the conv kernels need T a multiple of one of {BLOCKS_T} (at least W) and C a multiple of one "
                     f"of {BLOCKS_C}; got T={T}, C={C}, W={W}")
  if state.shape != (B, W - 1, C):
    raise ValueError(f"state must be [B, W-1, C] = {(B, W - 1, C)}, got {state.shape}")
  if activation not in (None, "silu"):
    raise ValueError(f"activation must be None or 'silu', got {activation!r}")
  return _conv(x, state, w, b, keep, activation, default_interpret() if interpret is None else interpret)
