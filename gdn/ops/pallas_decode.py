"""One decode step of a Gated DeltaNet layer, from its fused input projection to the gated-normed output, as one
Pallas (Triton) kernel per layer.

Shapes: B batch, H q/k heads, HV value heads (a multiple of H), K key dim, V value dim, W conv size,
C = 2 H K + HV V conv channels, N the fused projection's width; BV the value channels of one step of a program's
loop over V.

Why: at batch 1 a decode step is bound by kernel launches, not bytes (on the H200 the lean 12-layer model ran
235 XLA operations a step, ~19 a layer, 3.5x its weight-read floor). Everything between the fused input
projection and the output projection of one layer and one token is small elementwise work and a [K, V] state
update per value head; here it is one launch. One program per (batch row, value head) h, which reads q/k head
h // (HV / H) (grouped value attention), and per step of its loop over V in blocks of BV:

  x       = y[q | k | v channels of the head]                    y [B, N]: the fused projection's row
  q, k, v = SiLU(sum_j w[j] [window; x][j] (+ conv bias))         window [B, W-1, C] -> new window [window[1:]; x]
  q, k    = l2norm(q) / sqrt(K), l2norm(k)
  g       = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b) (x2 with allow_neg_eigval)
  S       = exp(g) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q      S [B, HV, K, V] float32, updated in place
  out     = RMSNorm(o) * weight * SiLU(gate)                       over the head's V channels

which is `RecurrentMixer`'s T == 1 path (short conv, l2 q/k norm, `gated_delta_rule_step` with a per-head decay
and beta, `GatedRMSNorm` with SiLU) with the same roundings to the compute dtype between its stages (the conv
output, the normalised q and k, o before the norm, the norm before the gate), so that bfloat16 results stay
within a rounding of XLA's. The arithmetic is float32; S^T k and S^T q are float32 products summed over K (a
matrix-vector product has no M >= 16 for Triton's dots).

The state is aliased in place (`input_output_aliases`): each program reads and writes only its own [K, V]
block. The conv window is not: under grouped value attention several programs read the same q/k channels, and
one that wrote them early would change another's input; they all write the same new values there.

Triton constraints (Pallas' interpreter checks none of them): power-of-two K, V and BV (`supports`), ref slices
of power-of-two length, no slicing of loaded values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops.pallas_common import default_interpret

# The fused kernel in `RecurrentMixer`'s decode step (T == 1 with a cache, fused projections, the Gated DeltaNet
# variant: `supports`): True, False, or None = where the Pallas kernels compile (not in the interpreter, whose
# per-program loop would only slow CPU runs down) and the batch has at least `MIN_BATCH` rows. Read when the step
# is traced. On one H200 (d_model 2048, 12 layers, bf16; docs/benchmarks.md) the kernel took a token from 1.186 to
# 1.030 ms at batch 8 and from 2.935 to 1.661 ms at batch 64, and was 6% slower at batch 1 (1.099 against 1.040).
DECODE_KERNEL: Optional[bool] = None
MIN_BATCH = 8  # the smallest batch at which the default (None) runs the kernel
BLOCK_V = 64  # value channels per step of a program's loop: a [128, 64] float32 state block is 64 registers a thread
# Keys wider than 128 (the paper models' 256): value steps of 32, the [256, 32] block's 64 registers a thread.
# Offline for sm_90 (Triton 3.9, ptxas -v, bfloat16, K = 256, V = 512, 4 warps): 226 registers and no spill at 32;
# 228 bytes of spill stores at 64 (`python -m experiments.kernel_resources --decode --k 256 --v 512`).
BLOCK_V_WIDE = 32
NUM_WARPS = 4
NUM_STAGES = 1
# The kernel's grid: False, one program per (batch row, value head) looping over V (above); True, one program per
# (batch row, value head, block of SPLIT_BLOCK_V value channels), each with its [K, BV] slice of the state, and the
# output RMSNorm over V and the gate in XLA after the kernel (a norm over V would need every block). At batch 1 the
# per-head grid is 16 programs for the H200's 132 SMs (16 heads; the kernel was 6% slower than XLA's step there,
# docs/benchmarks.md); the split grid makes it V / BV times as many. Read when the step is traced. Off: on the H200
# (d_model 2048, 12 layers, bfloat16) it took batch 1 from 1.116 ms a token (per head) to 1.053 against XLA's
# 1.075, within XLA's spread between days, and batch 64 from 1.673 to 1.936 (docs/benchmarks.md, decoding).
SPLIT_V = False
SPLIT_BLOCK_V = 16


def enabled(batch: int) -> bool:
  """Whether `DECODE_KERNEL` asks for the kernel now, for a decode step of `batch` rows."""
  if DECODE_KERNEL is None:
    return not default_interpret() and batch >= MIN_BATCH
  return bool(DECODE_KERNEL)


def _pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the pieces of one fused projection row y [N] lie, and the layer's static settings. q, k and v are the
  row's first 2 H K + HV V columns in that order (the conv's channel order); a and b have HV columns each from
  `a` and `b`, the gate HV V from `gate`."""
  H: int
  HV: int
  K: int
  V: int
  a: int
  b: int
  gate: int
  eps: float  # of the output RMSNorm
  allow_neg_eigval: bool
  qk_eps: float = 1e-6  # of the q/k l2norm


def default_block_v(K: int) -> int:
  """The value step when the caller names none: BLOCK_V, or BLOCK_V_WIDE for keys wider than 128."""
  return BLOCK_V if K <= 128 else BLOCK_V_WIDE


def supports(layout: Layout, W: int, block_v: Optional[int] = None) -> bool:
  """Whether the kernel takes these shapes: power-of-two K, V and value block, a conv window (W >= 2)."""
  bv = min(block_v or default_block_v(layout.K), layout.V)
  return _pow2(layout.K) and _pow2(layout.V) and _pow2(bv) and layout.V % bv == 0 and W >= 2


def _kernel(y_ref, win_ref, w_ref, *refs, lay: Layout, W: int, block_v: int, has_bias: bool, split: bool):
  if has_bias:
    cb_ref, *refs = refs
  alog_ref, dtb_ref, s_ref, nw_ref, o_ref, s_out_ref, win_out_ref = refs
  f32 = jnp.float32
  dt = y_ref.dtype
  H, HV, K, V = lay.H, lay.HV, lay.K, lay.V
  h = pl.program_id(1)
  hk = h // (HV // H)
  rnd = lambda x: x.astype(dt).astype(f32)  # a rounding to the compute dtype, where the XLA path has one

  def conv(off, n):
    """SiLU of the short conv over channels [off, off + n), and the new window's rows for them."""
    cs = pl.ds(off, n)
    x = y_ref[cs]
    acc = w_ref[W - 1, cs].astype(f32) * x.astype(f32)
    for j in range(W - 1):
      acc = acc + w_ref[j, cs].astype(f32) * win_ref[j, cs].astype(f32)
      win_out_ref[j, cs] = (win_ref[j + 1, cs] if j < W - 2 else x).astype(win_out_ref.dtype)
    if has_bias:
      acc = acc + cb_ref[cs].astype(f32)
    return rnd(jax.nn.silu(rnd(acc)))

  def l2norm(x):
    return rnd(x * jax.lax.rsqrt(jnp.sum(x * x) + lay.qk_eps))

  q = rnd(l2norm(conv(hk * K, K)) / math.sqrt(K))
  k = l2norm(conv(H * K + hk * K, K))
  one = pl.ds(h, 1)  # [1]-vectors: the head's scalars
  A = jnp.exp(alog_ref[one].astype(f32))
  g = -A * jax.nn.softplus(y_ref[pl.ds(lay.a + h, 1)].astype(f32) + dtb_ref[one].astype(f32))
  beta = jax.nn.sigmoid(y_ref[pl.ds(lay.b + h, 1)].astype(f32))
  if lay.allow_neg_eigval:
    beta = 2.0 * beta
  decay = jnp.exp(g)[:, None]  # [1, 1]

  def block(v_off, vs):
    """The state update of value channels [v_off, v_off + BV) (at vs of the state refs) and o there, rounded."""
    v = conv(2 * H * K + h * V + v_off, block_v)
    S = s_ref[:, vs] * decay  # [K, BV]
    u = beta * (v - jnp.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    s_out_ref[:, vs] = S
    return rnd(jnp.sum(S * q[:, None], axis=0))  # o in v's dtype, as the step returns it

  if split:  # this program's block of V; the norm and gate follow in XLA (`_norm_gate`)
    o_ref[...] = block(pl.program_id(2) * block_v, pl.ds(0, block_v)).astype(o_ref.dtype)
    return
  outs = [block(j * block_v, pl.ds(j * block_v, block_v)) for j in range(V // block_v)]
  r = jax.lax.rsqrt(sum(jnp.sum(o * o) for o in outs) / V + lay.eps)
  for j, o in enumerate(outs):
    vs = pl.ds(j * block_v, block_v)
    gate = y_ref[pl.ds(lay.gate + h * V + j * block_v, block_v)].astype(f32)
    o_ref[vs] = (rnd(o * r * nw_ref[vs].astype(f32)) * jax.nn.silu(gate)).astype(o_ref.dtype)


def _norm_gate(o, y, norm_w, lay: Layout):
  """The split kernel's tail in XLA: RMSNorm over each head's V channels of o [B, HV, V] (rounded to the compute
  dtype, as the kernel leaves it), its weight, then the SiLU gate from y, with the per-head kernel's roundings."""
  f32, dt = jnp.float32, y.dtype
  B = y.shape[0]
  of = o.astype(f32)
  r = jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + lay.eps)
  gate = jax.lax.dynamic_slice_in_dim(y, lay.gate, lay.HV * lay.V, axis=1).reshape(B, lay.HV, lay.V).astype(f32)
  normed = (of * r * norm_w.astype(f32)).astype(dt).astype(f32)
  return (normed * jax.nn.silu(gate)).astype(dt)


def fused_step(y, window, conv_w, conv_b, A_log, dt_bias, state, norm_w, *, layout: Layout,
               interpret: Optional[bool] = None, block_v: Optional[int] = None, split: Optional[bool] = None):
  """One token of a Gated DeltaNet layer after its fused input projection (see the module docstring).

  y [B, N] the fused projection's row (compute dtype); window [B, W-1, C] the conv's last inputs; conv_w [W, C],
  conv_b None or [C] the conv's weight and bias; A_log, dt_bias [HV]; state [B, HV, K, V] float32; norm_w [V]
  the output norm's weight. Returns (out [B, HV, V] in y's dtype, new state float32, new window in y's dtype,
  as the XLA conv's). Call only where `supports(layout, W)`; interpret: Pallas' interpreter, None: where the
  default backend is not a GPU; block_v: None for `default_block_v`, or SPLIT_BLOCK_V where split; split: the
  grid over value blocks with the norm and gate in XLA after it, None for `SPLIT_V` (both read at the call)."""
  lay = layout
  B, N = y.shape
  W = conv_w.shape[0]
  C = 2 * lay.H * lay.K + lay.HV * lay.V
  if window.shape != (B, W - 1, C) or conv_w.shape != (W, C) or state.shape != (B, lay.HV, lay.K, lay.V):
    raise ValueError(f"fused_step: window {window.shape}, conv_w {conv_w.shape}, state {state.shape} do not match "
                     f"B={B}, W={W}, C={C}, {lay}")
  if not supports(lay, W, block_v):
    raise ValueError(f"fused_step does not take {lay} with W={W}, block_v={block_v}: check `supports` first")
  interpret = default_interpret() if interpret is None else interpret
  split = SPLIT_V if split is None else split
  bv = min(block_v or (SPLIT_BLOCK_V if split else default_block_v(lay.K)), lay.V)
  if split and not supports(lay, W, bv):
    raise ValueError(f"fused_step(split=True) does not take {lay} with W={W}, value blocks of {bv}")
  has_bias = conv_b is not None
  grid = (B, lay.HV) + ((lay.V // bv,) if split else ())
  whole = lambda *s: pl.BlockSpec(s, lambda b, h, *j: (0,) * len(s))
  row = lambda *s: pl.BlockSpec((None,) + s, lambda b, h, *j: (b,) + (0,) * len(s))
  head = lambda *s: pl.BlockSpec((None, None) + s, lambda b, h, *j: (b, h) + (0,) * len(s))
  # The head's value channels: all of them, or (split) this program's block of them, the last axis.
  vblock = lambda *s: pl.BlockSpec((None, None) + s[:-1] + (bv,), lambda b, h, j: (b, h) + (0,) * (len(s) - 1) + (j,))
  per_v = vblock if split else head
  in_specs = [row(N), row(W - 1, C), whole(W, C)] + ([whole(C)] if has_bias else [])
  in_specs += [whole(lay.HV), whole(lay.HV), per_v(lay.K, lay.V), whole(lay.V)]
  args = [y, window, conv_w] + ([conv_b] if has_bias else []) + [A_log, dt_bias, state.astype(jnp.float32), norm_w]
  kernel = functools.partial(_kernel, lay=lay, W=W, block_v=bv, has_bias=has_bias, split=split)
  out, S, win = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs,
      out_specs=[per_v(lay.V), per_v(lay.K, lay.V), row(W - 1, C)],
      out_shape=[jax.ShapeDtypeStruct((B, lay.HV, lay.V), y.dtype),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32),
                 jax.ShapeDtypeStruct(window.shape, y.dtype)],
      input_output_aliases={len(args) - 2: 1}, interpret=interpret, name="gdn_decode_step",
      compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES))(*args)
  if split:
    out = _norm_gate(out, y, norm_w, lay)
  return out, S, win
