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
in XLA. With `FUSED_BWD` (no segments) one kernel does both: each block recomputes the pre-activation at the W
row windows that its dx reads, so dpre is never written.

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
# Channels: 64 first. On an H100 at the 340M step's conv (8, 4096, 6144), bfloat16, [64, 64] blocks at 4 warps took
# the conv's forward+backward to 1.267 ms, against 2.536 at [64, 128] and 8 warps and 1.460 for XLA's taps
# (`experiments/bench_conv.py`, results/benchmarks/h100_2026-12-07/conv_blocks.txt; docs/benchmarks.md).
BLOCKS_C = (64, 128, 32, 16)
# One block size to use in place of the first of BLOCKS_T / BLOCKS_C that divides the shape (0: that choice), e.g.
# for a sweep (`experiments/bench_conv.py --switch layers.conv_kernel.BLOCK_T=16,32,64`). Read at the call; a
# shape the size does not divide keeps XLA's taps.
BLOCK_T = 0
BLOCK_C = 0
# The backward as one kernel (`_bwd_fused_kernel`, no segment masks): True, each block recomputes the
# pre-activation at the W shifted row windows its dx reads (the taps' rows from L2), so that dpre is never
# written; dx, the weight's and the bias' partial sums in one pass over x and dy. False, the two kernels above
# (dpre written once, then read for dx). Read at the call. Off: on an H100 at (8, 4096, 6144), bfloat16, it took
# the conv's forward+backward 2.46-3.79 ms against the two kernels' 1.27-2.54 and the taps' 1.46, and the 340M step
# 601.0 ms against 546.6 (results/benchmarks/h100_2026-12-07/conv_blocks.txt, model_340m_conv.txt).
FUSED_BWD = False
# Warps per program: one per 1,024 elements of the block, at most 8 (4 at [64, 64]). At [64, 128] blocks, offline
# for sm_90 (Triton 3.9, ptxas -v, bfloat16, (8, 8192, 6144); `gdn.bench.kernel_resources`) 8 warps need 99-121
# registers a thread and spill nothing, where 4 warps need 255 and spill 92-96 bytes in the forward and dx kernels;
# at [64, 64] and 4 warps (as many elements a thread as [64, 128] at 8) they need 96-119 and spill nothing.
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


def _activation_ct(dy, pre, activation):
  """The pre-activation's cotangent from the output's: dy silu'(pre) for "silu", dy itself otherwise."""
  if activation != "silu":
    return dy
  sig = jax.nn.sigmoid(pre)
  return dy * sig * (1.0 + pre * (1.0 - sig))


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
  dy = _activation_ct(dy_ref[...].astype(pre.dtype), pre, activation)
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


def _bwd_fused_kernel(*refs, W, BT, nT, activation, has_b):
  """dx, and the weight's (and bias') partial sums of one block, dpre recomputed at each shifted window: dx[t] =
  sum_j w[j] dpre[t + s_j] with s_j = W-1-j, dpre[u] = dy[u] silu'(pre[u]), pre[u] = sum_i w[i] x[u - s_i] (+ b).
  x's rows before the sequence come from `head` ([zeros; state; x[:BT]]), x's and dy's beyond it from the tails
  ([x or dy of the last block; zeros]), which the last block alone reads; dy's zeros there zero those rows' dpre."""
  if has_b:
    x_ref, head_ref, xtail_ref, w_ref, b_ref, dy_ref, dytail_ref, dx_ref, dw_ref = refs
  else:
    (x_ref, head_ref, xtail_ref, w_ref, dy_ref, dytail_ref, dx_ref, dw_ref), b_ref = refs, None
  i = pl.program_id(1)
  ct = _ct(x_ref.dtype)
  tiles = {}

  def x_at(d):  # x's rows [i BT + d, i BT + d + BT), loaded once per offset
    if d not in tiles:
      if d < 0:
        tiles[d] = _window(x_ref, head_ref, i, i == 0, i * BT + d, BT + d, BT)
      elif d > 0:
        tiles[d] = _window(x_ref, xtail_ref, i, i == nT - 1, i * BT + d, d, BT)
      else:
        tiles[d] = x_ref[pl.ds(i * BT, BT), :]
    return tiles[d].astype(ct)

  wj = [w_ref[j, :].astype(ct)[None, :] for j in range(W)]
  acc = None
  for s in range(W):  # dpre at rows offset by s, which dx's tap j = W-1-s reads
    pre = None
    for tap in range(W):
      term = x_at(s - (W - 1) + tap) * wj[tap]
      pre = term if pre is None else pre + term
    if b_ref is not None:
      pre = pre + b_ref[0, :].astype(ct)[None, :]
    dy = (dy_ref[pl.ds(i * BT, BT), :] if s == 0 else
          _window(dy_ref, dytail_ref, i, i == nT - 1, i * BT + s, s, BT)).astype(ct)
    # rounded as the two kernels' dpre and `conv._conv_bwd`'s
    dpre = _activation_ct(dy, pre, activation).astype(x_ref.dtype).astype(ct)
    if s == 0:  # the block's own rows: the weight's and bias' sums
      for tap in range(W):
        dw_ref[tap, :] = jnp.sum(x_at(tap - (W - 1)) * dpre, axis=0)
      if has_b:
        dw_ref[W, :] = jnp.sum(dpre, axis=0)
    term = dpre * wj[W - 1 - s]
    acc = term if acc is None else acc + term
  dx_ref[...] = acc.astype(dx_ref.dtype)


def _dpre_rows(x, state, w, b, dy, activation, n: int):
  """dpre at the first n rows in XLA (the state's cotangent reads them; the fused kernel writes no dpre)."""
  ct = _ct(x.dtype)
  xp = jnp.concatenate([state.astype(x.dtype), x[:, :n]], axis=1).astype(ct)
  W = w.shape[0]
  pre = sum(xp[:, j:j + n] * w[j].astype(ct) for j in range(W))
  if b is not None:
    pre = pre + b.astype(ct)
  return _activation_ct(dy[:, :n].astype(ct), pre, activation).astype(x.dtype).astype(ct)


def _fused_bwd(x, state, w, b, dy, activation, interpret):
  B, T, C = x.shape
  W = w.shape[0]
  BT, BC = supported(T, C, W)
  nT = T // BT
  col, block, weight, bias, _, _ = _specs(W, BT, BC)
  dy = dy.astype(x.dtype)
  zeros = jnp.zeros((B, BT, C), x.dtype)
  ins = [x, _head(x, state, BT), jnp.concatenate([x[:, T - BT:], zeros], axis=1), w]
  specs = [col(T), col(2 * BT), col(2 * BT), weight]
  if b is not None:
    ins.append(b.reshape(1, C))
    specs.append(bias)
  ins += [dy, jnp.concatenate([dy[:, T - BT:], zeros], axis=1)]
  specs += [col(T), col(2 * BT)]
  rows = W + (b is not None)
  kernel = functools.partial(_bwd_fused_kernel, W=W, BT=BT, nT=nT, activation=activation, has_b=b is not None)
  dx, parts = pl.pallas_call(
      kernel, grid=(B, nT, C // BC), in_specs=specs,
      out_specs=[block, pl.BlockSpec((None, None, rows, BC), lambda b_, i, j: (b_, i, 0, j))],
      out_shape=[jax.ShapeDtypeStruct((B, T, C), x.dtype), jax.ShapeDtypeStruct((B, nT, rows, C), _ct(x.dtype))],
      interpret=interpret, name="gdn_short_conv_bwd_fused", compiler_params=_params(interpret, BT, BC))(*ins)
  sums = jnp.sum(parts, axis=(0, 1))
  db = None if b is None else sums[W].astype(b.dtype)
  return dx, sums[:W].astype(w.dtype), db, _dpre_rows(x, state, w, b, dy, activation, min(W - 1, T))


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


def _state_ct(d32, w, keep, state):
  """The state's cotangent from dpre's first rows d32 [B, >= W-1 or T, C] (float32): the state rows p < W-1 reach
  outputs u = p - j >= 0 through tap j (a few rows: XLA)."""
  B, C, W = d32.shape[0], d32.shape[2], w.shape[0]
  rows = []
  for p in range(W - 1):
    r = jnp.zeros((B, C), d32.dtype)
    for j in range(p + 1):
      u = p - j
      if u < d32.shape[1]:
        term = d32[:, u] * w[j].astype(d32.dtype)
        r = r + (term if keep is None else jnp.where(keep[:, u, j, None], term, 0.0))
    rows.append(r)
  return (jnp.stack(rows, axis=1) if rows else jnp.zeros((B, 0, C), d32.dtype)).astype(state.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, state, w, b, keep, activation, interpret):
  return _forward(x, state, w, b, keep, activation, interpret)


def _conv_fwd(x, state, w, b, keep, activation, interpret):
  return _forward(x, state, w, b, keep, activation, interpret), (x, state, w, b, keep)


def _conv_bwd(activation, interpret, res, dy):
  x, state, w, b, keep = res
  B, T, C = x.shape
  W = w.shape[0]
  if FUSED_BWD and keep is None:
    dx, dw, db, d32 = _fused_bwd(x, state, w, b, dy, activation, interpret)
    return dx, _state_ct(d32, w, None, state), dw, db, None
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

  f32 = _ct(x.dtype)
  d32 = dpre.astype(f32)
  dstate = _state_ct(d32, w, keep, state)
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
