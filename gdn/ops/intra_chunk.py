"""Chunk-local work of the chunkwise gated delta rule (the WY / UT form), for all chunks at once.

Shapes: B batch, HV value heads, N chunks, C chunk size, K key dim, V value dim, M sub-chunks, c sub-chunk size.

Inside a chunk with entering state S0, cumulative log-decay gamma_t and write vectors u_t, the recurrence
unrolls to

    u_t = beta_t * (v_t - S0^T (e^{gamma_t} k_t) - sum_{i<t} A_ti u_i),  A_ti = sum_c k_tc k_ic e^{gamma_tc - gamma_ic}
    o_t = S0^T (e^{gamma_t} q_t) + sum_{i<=t} P_ti u_i,                  P_ti = sum_c q_tc k_ic e^{gamma_tc - gamma_ic}
    S_C = Diag(e^{gamma_C}) S0 + sum_i (e^{gamma_C - gamma_i} k_i) u_i^T

With per-head beta, U = (I + Diag(beta) A)^{-1} Diag(beta) (V - Ktil S0) = Unew - W S0: one unit-lower-triangular
solve per chunk with K + V right-hand sides. Every exponent is a sum of the (non-positive) log-decays over the
positions it spans, computed as such a sum and never as a difference of two long cumulative sums: a difference
of two large cumulative sums loses all precision when a strong decay precedes weak ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gdn.ops import checks, pallas_diag
from gdn.ops.pallas_common import default_interpret

SUB_CHUNK = 16
# The chunk-local stage's differentiated forward and backward over groups of chunks (`grouped`): 1 (today) lets JAX
# differentiate `local`, which keeps its intermediates and runs its backward over all chunks at once; G > 1 keeps
# only its inputs and runs forward and backward over G groups of chunks in turn, the backward recomputing each
# group's forward, so that the float32 [C, C] and [C, K] intermediates and their cotangents exist for one group at
# a time. The default of `gated_delta_rule(local_groups=None)`, read at the call.
LOCAL_GROUPS = 1
# The chunk-local stage's VJP for a per-head decay and a per-head beta (Gated DeltaNet, blocked solver): True, the
# hand-derived `_local_bwd` (batched matmuls from the inputs and the saved inverse); False, JAX's autodiff of
# `local`. Read at trace time (`local` reads it, so every caller differentiating `local` follows it: "chunk",
# "pallas" through `pallas_local`'s reference VJP, `grouped`). Off: on one H200 it made the op's bfloat16 training
# step 6-13% slower than autodiff with the inverse's own VJP (docs/benchmarks.md, switch_local_vjp.txt).
LOCAL_VJP = False
# The W/U solve's operands with 16-bit q, k, v (blocked solver, per-head beta): True, the right-hand sides
# [beta k_dec, beta v] and the inverse T rounded to the inputs' dtype before their matmul (products exact and
# accumulated in float32, as `mm`), and W and U made as two products with their own VJP (`_apply_lowp`), so the
# [L, C, K], [L, C, V] and [L, C, C] arrays the backward keeps, the inverse's own VJP residual included, and their
# cotangents are 16-bit; False, one joint float32 [L, C, K + V] right-hand side and a float32 inverse. float32 and
# float64 inputs are unaffected. Read at trace time, like LOCAL_VJP. On the H200 True takes the Gated DeltaNet
# layer's bfloat16 training step (d_model 2048, 8 x 8192 tokens, pallas) from 29.52 to 27.33 ms and its peak from
# 8.22 to 7.60 GiB (fla's layer: 27.14 ms, 6.40 GiB); on CPU it adds up to 25% to the bfloat16 pipeline's errors
# against the float64 oracle (docs/benchmarks.md).
LOWP_SOLVE = True
# LOWP_SOLVE's two products W = T (Diag(beta) k_dec) and U = T (Diag(beta) v) with beta kept apart in their VJP
# (per-head beta, per-head or no decay, 16-bit inputs): True, one `jax.custom_vjp` (`_solve_apply`) that takes k
# and its per-row decay e (k_dec = k e) rather than a k_dec copy, and whose backward forms the [C, C]
# G = dW k^T Diag(e) + dU v^T once and takes dT = G Diag(beta), beta's share colsum(T * G) (a reduction over
# [C, C] per chunk, in the chunk layout) and dk, de, dv from T^T (dW, dU), every product written in the 16-bit
# dtype as `_apply_lowp`'s; False, `_apply_lowp` per product and autodiff of beta k_dec and beta v, whose share of
# beta's gradient, rowsum((T^T dU) * v), XLA:GPU forms in one fusion with v's relayout and the gradient's
# transpose back to [B, T, HV] (0.54 ms of 6.24 at (2, 16384, 16, 128) on the H200, bfloat16:
# results/benchmarks/h200_2026-12-03/profile_gdn_hlo.txt). The forward's values are the same. A first form (float32
# G and T^T dX, a k_dec copy kept; 9a248da) took that fusion to 0.19 ms but the op's forward+backward to 0.998,
# 1.028 and 1.077 of its time at three shapes; this one to 0.957, 1.079 and 1.016 ((2, 16384, 16, 128),
# (4, 2048, 16, 128), (1, 8192, 96, 128)) and the layer's step to 0.995 with 0.09 GiB less peak
# (docs/benchmarks.md): off. Read at trace time.
SOLVE_BETA_VJP = False
# The span sums of the log-decays in the chunk-local stage: the pairwise seg[t, i] = sum_{i < j <= t} g_j
# (`_segsum`; per head over the chunk, per key channel over each sub-chunk), gamma_t = sum_{j <= t} g_j and the sums
# to the chunk's end. True, each one float32 matmul of g with a constant 0/1 tensor (full float32 precision: the
# same direct sums, summed in another order), so that its VJP is the transposed matmul; False, cumulative sums
# (the pairwise one over the masked [.., C, C] matrix), which XLA:GPU runs as chains of small slices and windowed
# sums: the VJP of the pairwise one, windowed sums over the [L, C, C] cotangent, was the chunk-local backward's
# largest kernel (1.16 of 7.53 ms at (2, 16384, 16, 128) on the H200). None (the default): matmuls (True) for a
# per-head decay and for KDA's dyadic form, "primal" (below) for KDA's pairwise and bounded forms, as each was
# last timed. Per head, on the H200 (bfloat16, pallas, docs/benchmarks.md), matmuls take forward+backward to
# 0.85-0.98 of the cumulative sums' time over the five benchmark shapes. Per key channel, with the pairwise form
# (2026-12-02) they took the forward to 0.62 but forward+backward to 1.48; with the dyadic form, its diagonal
# kernel and 16-bit level dots, they take KDA's forward+backward to 0.94-0.96x of "primal"'s on an H100 (two
# calls, 2026-12-06; docs/benchmarks.md).
# "primal": the matmuls where the op is not differentiated (inference, prefill, evaluation) and the cumulative sums
# where it is (the forward rule and VJP of a `jax.custom_vjp`), so that a training step is exactly the cumulative
# sums' program (9.61 ms forward+backward at that KDA shape) and a forward-only call the matmuls' (2.65 ms against
# 4.54). The matmuls in the differentiated forward with the cumulative sums' VJP took 14.67 ms there: the backward's
# loss comes from the matmuls' forward inside the differentiated program, not from their VJP. "vjp": as "primal",
# but the VJP is the matmuls' transpose (the cumulative sums' transposes are reverse windowed sums, which XLA:GPU
# evaluates window by window: in KDA's backward they sit in dg's fusion, 0.38 ms of 4.78 at (4, 2048, 16, 128) on
# an H100, at a third of the bandwidth its bytes need; docs/benchmarks.md). Read at trace time.
SEGSUM_MATMUL = None
# The pair products of a per-head decay (`_pair_scalar`: K K^T and Q K^T, float32 [L, C, C] each, times the decay
# matrix): True, under `jax.checkpoint`, so that the backward recomputes them from q, k and g (two [C, K] x [K, C]
# products and an exp per chunk) instead of keeping them; False, autodiff keeps the two float32 products (512 MiB
# of the Gated DeltaNet layer's live set at d_model 2048, 8 x 8192 tokens). Read at trace time. Off: on the H200
# True took that layer's bfloat16 training step from 27.26 to 28.17 ms for a peak 0.12 GiB lower
# (docs/benchmarks.md).
PAIR_REMAT = False
# The same for a per-key-channel decay (KDA, `_pair_channel`): True, under `jax.checkpoint`, so that the backward
# recomputes A and P from q, k and g instead of keeping the float32 diagonal sub-chunk decays [L, C/16, 16, 16, K],
# the off-diagonal factors [L, n, m, 16, K] and their products with k and q: 3,385 -> 469 MiB of residuals for the
# op at (64, 512, 2 heads x 128), bfloat16, pallas. On the H200 a 16-layer KDA model's training step (64 x 512
# tokens) went from 24.0 to 11.8 GiB peak and from 110.6 to 102.8 ms (docs/experiments.md). XLA:CPU's compiled
# estimate does not fall with it (its scheduler runs every layer's recomputation at once). False: autodiff keeps
# them. Read at trace time.
CHANNEL_PAIR_REMAT = True
# The bounded factorisation's dots (`_pair_channel_bounded`, `gated_delta_rule(g_lower_bound=...)`): True, their
# operands (the keys and queries times their decay factors) rounded to the inputs' dtype where it is 16-bit, as
# the fused kernel's off-diagonal dots and fla's safe_gate kernel take them: half the bytes of the [M, M, 16, K]
# column factors and bfloat16 tensor-core products, float32 accumulation; False, float32 operands (at the
# caller's precision: one TF32 pass for bfloat16 callers on a GPU). Read at trace time. On: 0.78x forward and
# 0.72x forward+backward at (4, 2048, 16, 128) on an H100 (docs/benchmarks.md, "KDA with a bounded gate"),
# within the bfloat16 tolerance of the float64 oracle (`tests/test_g_lower_bound.py`).
BOUNDED_LOWP_DOTS = True
# The exact per-key-channel stage (no `g_lower_bound`) for a chunk of 2^n positions: True, `_pair_channel_dyadic`
# (every pair's decay factored at the one dyadic boundary between its two steps: log2(C) batched matmuls, no
# [c, c, K] pairwise decays); False, `_pair_channel` (pairwise decays inside 16-step sub-chunks). Both exact for
# any g. Read at trace time. On: on CPU it takes the KDA op to 0.43x its time and XLA's memory estimate; on an
# H200 to 0.89x (forward) and 0.62x (forward+backward), and the KDA 3:1 model's step to 0.87x (docs/benchmarks.md,
# "KDA's exact form by dyadic anchors").
CHANNEL_PAIR_DYADIC = True
# The dyadic form's level dots (`_pair_channel_dyadic`): True, their operands (the keys and queries times their
# anchored decay factors, each e^{x <= 0}) rounded to the inputs' dtype where it is 16-bit, as BOUNDED_LOWP_DOTS
# does for the bounded form: half the bytes of the [.., C/2s, s, K] factors and bfloat16 tensor-core products,
# float32 accumulation; False, float32 operands (at the caller's precision: one TF32 pass for bfloat16 callers on a
# GPU). Within the bfloat16 tolerance of the float64 oracle (`tests/test_kda_dyadic.py`; on CPU dg's error against
# it 3.3e-3 -> 4.3e-3, `experiments.kda_local_accuracy`). Read at trace time. On: 0.94-0.96x forward+backward at
# (4, 2048, 16, 128), (2, 16384, 16, 128) and (4, 4096, 64, 128) on an H100, in two calls (docs/benchmarks.md).
DYADIC_LOWP_DOTS = True
# The dyadic form's levels below SUB_CHUNK (the pairs inside each sub-chunk of 16 steps: four rounds of small
# batched matmuls, exponentials and block assemblies over the whole [L, C, K] layout) as one Pallas kernel per
# direction, `pallas_diag.diag_blocks`: one program per sub-chunk, exact span sums, its own backward kernel. True,
# False, or None = where the Pallas kernels compile (a GPU; in Pallas' interpreter it would only slow CPU runs
# down). For 16- and 32-bit inputs and chunks of a multiple of 16 steps; the levels from 16 up stay in XLA. Read
# at trace time. On an H100 (2026-12-06), with the kernels' tuned settings, it takes the KDA op's bfloat16
# forward+backward to 0.74x at (4, 2048, 16, 128) and 0.69x at (2, 16384, 16, 128), and the KDA 3:1 model's
# training step to 57.3 ms from 81.5 (two calls; docs/benchmarks.md, results/benchmarks/h100_2026-12-06/).
CHANNEL_DIAG_KERNEL: Optional[bool] = None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_dec", "k_dec", "k_end", "decay", "P", "A", "W", "U"], meta_fields=[])
@dataclasses.dataclass
class Local:
  """What the chunk-to-chunk recurrence and the output need, per chunk: [L, ...] (or [B, HV, N, ...])."""
  q_dec: jax.Array  # [.., C, K] scale * q_t * e^{gamma_t}, zero where a reset cut it from the entering state
  k_dec: Optional[jax.Array]  # [.., C, K] k_t * e^{gamma_t}, likewise masked (None from pallas_local)
  k_end: jax.Array  # [.., C, K] k_i * e^{gamma_C - gamma_i}, zero unless i reaches the chunk end
  decay: jax.Array  # [.., 1 or K] e^{gamma_C}, zero if the chunk holds a reset
  P: jax.Array  # [.., C, C] intra-chunk output weights (lower triangular, diagonal included)
  A: Optional[jax.Array]  # [.., C, C] strictly lower A (None without delta rule, and from pallas_local)
  W: Optional[jax.Array]  # [.., C, K] (per-head beta only)
  U: jax.Array  # [.., C, V] Unew (per-head beta), v (no beta), v (per-channel beta: solved later)


def mm(spec, *xs, precision):
  """`jnp.einsum` that accumulates and returns float32 (float64 for float64 operands), whatever the operands'
  dtype: 16-bit chunk-local operands never round a product's result to 16 bits."""
  acc = jnp.promote_types(jnp.float32, jnp.result_type(*xs))
  return jnp.einsum(spec, *xs, precision=precision, preferred_element_type=acc)


def _dot(prec):
  return lambda spec, *xs: mm(spec, *xs, precision=prec)


def _cumsum_incl(g, axis):
  return jnp.cumsum(g, axis=axis)


def _cumsum_rev_excl(g, axis):
  """sum_{j > t} g_j along `axis`, as a direct sum (no subtraction)."""
  shifted = jnp.concatenate([jax.lax.slice_in_dim(g, 1, None, axis=axis),
                             jnp.zeros_like(jax.lax.slice_in_dim(g, 0, 1, axis=axis))], axis=axis)
  return jnp.flip(jnp.cumsum(jnp.flip(shifted, axis), axis=axis), axis)


def _sum_mode(form: str) -> str:
  """How the span sums of the log-decays are formed (`SEGSUM_MATMUL`): "cumsum", "matmul" (its VJP the transposed
  matmul), "primal" (the matmul when not differentiated, else the cumulative sums) or "vjp" ("primal" with the
  matmul's transpose as the VJP). None: "matmul" for the `form`s "head" (a per-head decay) and "dyadic" (KDA's
  dyadic form), "primal" for "pairwise" and "bounded" (KDA's other forms)."""
  if form not in ("head", "dyadic", "pairwise", "bounded"):
    raise ValueError(f"_sum_mode: unknown form {form!r}")
  if SEGSUM_MATMUL is None:
    return "matmul" if form in ("head", "dyadic") else "primal"
  if isinstance(SEGSUM_MATMUL, str):
    if SEGSUM_MATMUL not in ("primal", "vjp"):
      raise ValueError(f"intra_chunk.SEGSUM_MATMUL: expected True, False, None, 'primal' or 'vjp', "
                       f"got {SEGSUM_MATMUL!r}")
    return SEGSUM_MATMUL
  return "matmul" if SEGSUM_MATMUL else "cumsum"


def _by_mode(mode, matmul_fn, cumsum_fn, g):
  """matmul_fn(g) or cumsum_fn(g) (the same sums, the matmul's in float32 at least) by `_sum_mode`; "primal": a
  `jax.custom_vjp` whose primal is the matmul and whose forward rule and VJP are the cumulative sums' (both linear
  in g: the VJP is their transpose, traced without their forward); "vjp": the same with the matmul's transpose as
  the VJP."""
  if mode == "cumsum":
    return cumsum_fn(g)
  if mode == "matmul":
    return matmul_fn(g)
  dt = jnp.promote_types(g.dtype, jnp.float32)
  widened = lambda g: cumsum_fn(g.astype(dt))  # the matmul's dtype, as the custom_vjp's primal output

  @jax.custom_vjp
  def sums(g):
    return matmul_fn(g)

  def fwd(g):
    return widened(g), g

  def bwd(g, ct):
    if mode == "vjp":
      return jax.linear_transpose(lambda g: matmul_fn(g.astype(dt)), g)(ct)
    return jax.linear_transpose(widened, g)(ct)

  sums.defvjp(fwd, bwd)
  return sums(g)


def _segsum_cumsum(g, axis):
  """`_segsum` as a cumulative sum over the masked [.., L, L] matrix."""
  L = g.shape[axis]
  j = jnp.arange(L)
  keep = (j[:, None] > j[None, :])  # [j, i]
  gj = jnp.expand_dims(g, axis + 1)  # [.., j, 1, ..]
  keep = keep.reshape((L, L) + (1,) * (g.ndim - axis - 1))
  return jnp.cumsum(jnp.where(keep, gj, 0.0), axis=axis)


def _segsum(g, axis, *, mode: str):
  """out[t, i] = sum_{i < j <= t} g_j for i <= t, 0 above the diagonal. g has length L along `axis`;
  the result inserts a new axis after it (t at `axis`, i at `axis + 1`). mode: from `_sum_mode`."""
  return _by_mode(mode, lambda g: _segsum_matmul(g, axis), lambda g: _segsum_cumsum(g, axis), g)


def _incl_sums(g, axis, *, mode: str):
  """gamma_t = sum_{j <= t} g_j along `axis`, by `mode`."""
  return _by_mode(mode, lambda g: _span_sums(g, axis, lambda t, j: j <= t), lambda g: _cumsum_incl(g, axis), g)


def _rev_excl_sums(g, axis, *, mode: str):
  """sum_{j > t} g_j along `axis` (to the chunk's or sub-chunk's end), by `mode`."""
  return _by_mode(mode, lambda g: _span_sums(g, axis, lambda t, j: j > t), lambda g: _cumsum_rev_excl(g, axis), g)


def _sums(g, axis, spans, mask_axes):
  """Sums of g over spans of `axis` as one full-precision matmul with a 0/1 mask (SEGSUM_MATMUL): the mask
  spans(*iotas) has the axes `mask_axes` (j, the summed one, last); the output puts the others where `axis` was."""
  C = g.shape[axis]
  iotas = [jax.lax.broadcasted_iota(jnp.int32, (C,) * len(mask_axes), d) for d in range(len(mask_axes))]
  dt = jnp.promote_types(g.dtype, jnp.float32)
  rest = "abcdefgh"[:g.ndim - axis - 1]  # the axes after `axis` (a key channel's K for per-channel decay)
  return jnp.einsum(f"...j{rest},{mask_axes}->...{mask_axes[:-1]}{rest}", g.astype(dt), spans(*iotas).astype(dt),
                    precision=jax.lax.Precision.HIGHEST, preferred_element_type=dt)


def _segsum_matmul(g, axis):
  """`_segsum` as one matmul: out[.., t, i, ..] = sum_j g[.., j, ..] [i < j <= t]."""
  return _sums(g, axis, lambda t, i, j: (i < j) & (j <= t), "tij")


def _span_sums(g, axis, spans):
  """out[.., t, ..] = sum_j g[.., j, ..] [spans(t, j)] along `axis` (gamma and the sums to the chunk's end)."""
  return _sums(g, axis, spans, "tj")


def _pair_scalar(q, k, g, dot):
  """A (unmasked) and P for one decay per head. q,k [.., C, K]; g [.., C]."""
  C = g.shape[-1]
  incl = jnp.tril(jnp.ones((C, C), bool))
  D = jnp.exp(jnp.where(incl, _segsum(g, g.ndim - 1, mode=_sum_mode("head")), -jnp.inf))
  return dot("...tk,...ik->...ti", k, k) * D, dot("...tk,...ik->...ti", q, k) * D


def _sub_chunks(q, k, g):
  """(M, c, lead, (q, k, g) as [.., M, c, K]): the chunk's C positions as M sub-chunks of c = SUB_CHUNK (or one
  of C where C is not a multiple of it)."""
  C, K = k.shape[-2:]
  c = SUB_CHUNK if C % SUB_CHUNK == 0 else C
  M = C // c
  lead = k.shape[:-2]
  return M, c, lead, tuple(x.reshape(lead + (M, c, K)) for x in (q, k, g))


def _pair_channel(q, k, g, dot):
  """A (unmasked) and P for one decay per key channel, without e^{+x} overflow.

  Diagonal sub-chunk blocks use the exact pairwise decay [c, c, K]; a block (n, m), n > m, factors the decay
  through the last position r of sub-chunk m: e^{gamma_t - gamma_i} = e^{gamma_t - gamma_r} e^{gamma_r - gamma_i},
  both exponents <= 0.
  """
  C, K = k.shape[-2:]
  mode = _sum_mode("pairwise")
  M, c, lead, (qs, ks, gs) = _sub_chunks(q, k, g)
  # Diagonal blocks: D[n, t, i, :] = sum_{i < j <= t} g_j inside sub-chunk n.
  incl = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
  Dd = jnp.exp(jnp.where(incl, _segsum(gs, gs.ndim - 2, mode=mode), -jnp.inf))  # [.., M, c, c, K]
  A_d = dot("...ntk,...nik,...ntik->...nti", ks, ks, Dd)
  P_d = dot("...ntk,...nik,...ntik->...nti", qs, ks, Dd)
  eye = jnp.eye(M, dtype=k.dtype)
  blockdiag = lambda X: jnp.einsum("...nti,nm->...ntmi", X, eye).reshape(lead + (C, C))
  if M == 1:
    return blockdiag(A_d), blockdiag(P_d)
  # Off-diagonal blocks.
  F = _incl_sums(gs, gs.ndim - 2, mode=mode)  # [.., M, c, K] local inclusive: sum over (start of n, t]
  R = _rev_excl_sums(gs, gs.ndim - 2, mode=mode)  # sum over (i, end of m]
  tot = F[..., -1, :]  # [.., M, K]
  # between[n, m] = sum_{m < l < n} tot_l
  nn = jnp.arange(M)
  Y = _segsum(tot, tot.ndim - 2, mode=mode)  # [.., l->n, m, K] sum_{m<l<=n}, 0 for n <= m
  between = jnp.concatenate([jnp.zeros_like(Y[..., :1, :, :]), Y[..., :-1, :, :]], axis=-3)  # [.., n, m, K]
  later = (nn[:, None] > nn[None, :])  # [n, m]
  X = F[..., :, None, :, :] + between[..., :, :, None, :]  # [.., n, m, t, K]
  X = jnp.where(later[:, :, None, None], X, -jnp.inf)
  fac = jnp.exp(X)
  kL = ks[..., :, None, :, :] * fac  # [.., n, m, t, K]
  qL = qs[..., :, None, :, :] * fac
  kR = ks * jnp.exp(R)  # [.., m, i, K]
  A_o = dot("...nmtk,...mik->...ntmi", kL, kR).reshape(lead + (C, C))
  P_o = dot("...nmtk,...mik->...ntmi", qL, kR).reshape(lead + (C, C))
  return A_o + blockdiag(A_d), P_o + blockdiag(P_d)


def dyadic_ok(C: int) -> bool:
  """Whether a chunk of C positions halves down to single steps, as `_pair_channel_dyadic` needs."""
  return C >= 2 and C & (C - 1) == 0


def channel_pairs(q, k, g, prec):
  """(A, P) of the exact per-key-channel stage for q (scaled), k, g [.., C, K], C a power of two: the dyadic
  form below at `prec`, with `pallas_diag`'s kernel for the levels under 16 where CHANNEL_DIAG_KERNEL says so.
  Public for the benchmarks and tests that time and check those levels."""
  return _pair_channel_dyadic(q, k, g, _dot(prec))


def _pair_channel_dyadic(q, k, g, dot):
  """A (strictly lower: zero on and above the diagonal, which `_local` never reads) and P (lower, diagonal
  included) for one decay per key channel, exact for any g <= 0, as batched matmuls: no [c, c, K] pairwise decays.
  C must be a power of two (`dyadic_ok`).

  Every pair t > i is split by exactly one dyadic boundary a: the level s (1, 2, .., C/2) whose blocks of 2s
  steps hold t in their upper half [a, a + s) and i in their lower half [a - s, a). Anchored there, its decay
  factors as e^{gamma_t - gamma_i} = e^{sum over (a, t]} e^{sum over (i, a]}, both exponents <= 0 (no overflow,
  whatever the gate), each a sum inside one half block (no cancellation against a chunk-long cumulative sum).
  Each level is one batched matmul of [C/2s, s, K] by [C/2s, K, s]: log2(C) levels whose operands hold C/2
  positions each, against the [C/16, 16, 16, K] pairwise decays of `_pair_channel`'s diagonal blocks. With
  CHANNEL_DIAG_KERNEL the levels below 16 (each sub-chunk's own pairs) come from `pallas_diag.diag_blocks`."""
  C, K = k.shape[-2:]
  mode = _sum_mode("dyadic")
  lead = k.shape[:-2]
  if pallas_diag.use(CHANNEL_DIAG_KERNEL) and pallas_diag.supported(C, jnp.result_type(q, k, g)):
    # the levels below SUB_CHUNK, every sub-chunk's own pairs, by the kernel: W_A, W_P [.., C / 16, 16, 16]
    W_A, W_P = pallas_diag.diag_blocks(q, k, g, default_interpret())
    s = pallas_diag.SUB
  else:
    W_A = jnp.zeros(lead + (C, 1, 1), jnp.promote_types(k.dtype, jnp.float32))
    W_P = dot("...tk,...tk->...t", q, k)[..., None, None].astype(W_A.dtype)  # the diagonal: decay 1
    s = 1
  while s < C:
    nb = C // (2 * s)
    q5, k5, g5 = (x.reshape(lead + (nb, 2, s, K)) for x in (q, k, g))
    gu, gl = g5[..., 1, :, :], g5[..., 0, :, :]  # [.., nb, s, K]: the upper half (rows), the lower (columns)
    k_rows, q_rows = k5[..., 1, :, :], q5[..., 1, :, :]
    if s == 1:
      # The pair (a - 1, a) decays by e^{g_a}: the sum over (a, t] is empty, over (i, a] g_a alone. (As cumulative
      # sums over one step they were sums of constant zeros, which XLA's GPU compiler folds element by element:
      # seconds for each one, minutes for a model.)
      down = gu
    else:
      ax = gu.ndim - 2
      first = jnp.arange(s)[:, None] == 0
      e_up = jnp.exp(_incl_sums(jnp.where(first, 0.0, gu), ax, mode=mode))  # sum over (a, t]
      k_rows, q_rows = k_rows * e_up, q_rows * e_up
      down = _rev_excl_sums(gl, ax, mode=mode) + gu[..., :1, :]  # sum over (i, a]
    cols = k5[..., 0, :, :] * jnp.exp(down)
    if DYADIC_LOWP_DOTS and jnp.dtype(k.dtype).itemsize == 2:
      cols, k_rows, q_rows = (x.astype(k.dtype) for x in (cols, k_rows, q_rows))
    blocks = []
    for W, rows in ((W_A, k_rows), (W_P, q_rows)):
      B = dot("...btk,...bik->...bti", rows, cols).astype(W.dtype)  # [.., nb, s, s]
      W = W.reshape(lead + (nb, 2, s, s))
      top = jnp.concatenate([W[..., 0, :, :], jnp.zeros_like(B)], axis=-1)
      bottom = jnp.concatenate([B, W[..., 1, :, :]], axis=-1)
      blocks.append(jnp.concatenate([top, bottom], axis=-2))  # [.., nb, 2s, 2s]
    W_A, W_P = blocks
    s *= 2
  return W_A.reshape(lead + (C, C)), W_P.reshape(lead + (C, C))


# The most negative log-decay a step that `local`'s bounded factorisation (`g_lower_bound`) accepts: a
# sub-chunk of SUB_CHUNK steps then spans at least 16 x -5 = -80, and e^80 = 5.5e34 stays inside float32's range
# (and bfloat16's) with a margin of about 6,000 for the products with the keys.
MIN_G_LOWER_BOUND = -5.0


def clamp_to_bound(g, g_lower_bound):
  """(g, bound): an op's `g_lower_bound` validated (None, or a float in [MIN_G_LOWER_BOUND, 0) given with a g)
  and g clamped to it, g itself where it is None. Not jnp.maximum, whose gradient halves where g equals the bound."""
  bound = checks.check_g_lower_bound(g_lower_bound, g, MIN_G_LOWER_BOUND)
  if bound is None:
    return g, None
  return jnp.where(g < bound, jnp.asarray(bound, g.dtype), g), bound


def bounded_ok(C: int) -> bool:
  """Whether a chunk of C positions splits into sub-chunks of at most SUB_CHUNK, as the bounded factorisation
  needs (otherwise `local` takes the exact form)."""
  return C <= SUB_CHUNK or C % SUB_CHUNK == 0


def _pair_channel_bounded(q, k, g, dot):
  """A (strictly lower: zero on and above the diagonal, which `_local` never reads) and P (lower, diagonal
  included) for one decay per key channel whose every log-decay lies in [MIN_G_LOWER_BOUND, 0]: all of it as
  batched matmuls, no [c, c, K] pairwise decays.

  Each row block n (sub-chunk n, anchored at its start) factors e^{gamma_t - gamma_i} as e^{F_t} e^{E_{n,i}}:
  F_t = the sum of g over block n's steps up to t (its first included), in [16 lb, 0]; E_{n,i} = -F_i inside
  block n (at most -16 lb = 80, so e^{E} <= 5.5e34), and for an earlier block m the span sum from i to n's start
  (<= 0, `_pair_channel`'s R plus the blocks between). Later blocks get E = -inf (a zero factor, no overflow)."""
  C, K = k.shape[-2:]
  mode = _sum_mode("bounded")
  M, c, lead, (qs, ks, gs) = _sub_chunks(q, k, g)
  F = _incl_sums(gs, gs.ndim - 2, mode=mode)  # [.., M, c, K]
  nn = jnp.arange(M)
  same = (nn[:, None] == nn[None, :])[:, :, None, None]  # [n, m, 1, 1]
  E = jnp.broadcast_to(-F[..., :, None, :, :], lead + (M, M, c, K))  # block n's own columns: -F_i
  if M > 1:
    R = _rev_excl_sums(gs, gs.ndim - 2, mode=mode)  # [.., m, i, K] sum over (i, end of m]
    Y = _segsum(F[..., -1, :], F.ndim - 3, mode=mode)  # [.., n, m, K] sum_{m < l <= n} of the blocks' totals
    between = jnp.concatenate([jnp.zeros_like(Y[..., :1, :, :]), Y[..., :-1, :, :]], axis=-3)  # m < l < n
    earlier = (nn[:, None] > nn[None, :])[:, :, None, None]
    E = jnp.where(earlier, between[..., :, :, None, :] + R[..., None, :, :, :], E)
    E = jnp.where(same | earlier, E, -jnp.inf)
  e_F = jnp.exp(F)
  cols, k_rows, q_rows = ks[..., None, :, :, :] * jnp.exp(E), ks * e_F, qs * e_F  # cols [.., n, m, i, K]
  if BOUNDED_LOWP_DOTS and jnp.dtype(k.dtype).itemsize == 2:
    cols, k_rows, q_rows = (x.astype(k.dtype) for x in (cols, k_rows, q_rows))
  A = dot("...ntk,...nmik->...ntmi", k_rows, cols).reshape(lead + (C, C))
  P = dot("...ntk,...nmik->...ntmi", q_rows, cols).reshape(lead + (C, C))
  # Above the diagonal inside a block the factors give e^{+x} (up to e^80 times the keys' products): finite,
  # and cut here by a select, so that neither those values nor their cotangents reach anything else. The
  # diagonal (decay e^0 = 1, no g in it) is cut too and P's is q_t . k_t directly: through the factors its
  # cotangent would reach F_t twice, once from each side, with opposite signs, and their float32 difference
  # would swamp g's small gradient under a strong decay (4e-2 relative at g = -5 everywhere, against 7e-8).
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  P_diag = dot("...tk,...tk->...t", q, k)
  return jnp.where(strict, A, 0.0), jnp.where(strict, P, jnp.where(jnp.eye(C, dtype=bool), P_diag[..., None], 0.0))


def local(q, k, v, g, beta, masks, *, beta_kind: str, prec, solver: str = "blocked",
          g_lower_bound: Optional[float] = None) -> Local:
  """Chunk-local quantities for L = B*HV*N chunks. q (already scaled), k [L,C,K]; v [L,C,V];
  g None, [L,C] or [L,C,K]; beta None, [L,C] or [L,C,V];
  masks None or (same [L,C,C], carries [L,C], reaches_end [L,C], unbroken [L,1]).
  solver: "triangular" (`lax.linalg.triangular_solve`) or "blocked" (`invert_unit_lower`, then a matmul).
  16-bit q, k, v: products accumulate in float32, and the outputs but decay and A come back in their dtype.
  Differentiated, its VJP is autodiff's, or with LOCAL_VJP the hand-derived `_local_bwd` (per-head decay and
  beta, blocked solver). g_lower_bound: None, or a promise that every g >= it (>= MIN_G_LOWER_BOUND): a per-key-
  channel decay then takes the bounded factorisation (`_pair_channel_bounded`, matmuls only) where the chunk
  splits into sub-chunks of at most SUB_CHUNK; the op (`gated_delta_rule`) keeps the promise by clamping g."""
  if LOCAL_VJP and g is not None and g.ndim == 2 and beta_kind == "head" and solver == "blocked":
    return _local_own_vjp(prec, q, k, v, g, beta, masks)
  return _local(q, k, v, g, beta, masks, beta_kind=beta_kind, prec=prec, solver=solver,
                g_lower_bound=g_lower_bound)[0]


def _local(q, k, v, g, beta, masks, *, beta_kind: str, prec, solver: str, g_lower_bound=None):
  """`local`'s forward: (Local, T), T = (I + Diag(beta) A)^{-1} [L, C, C] from the blocked solver (float32, or the
  16-bit inputs' dtype with LOWP_SOLVE), else None."""
  odt = k.dtype
  dot = _dot(prec)
  C = k.shape[-2]
  if g is None:
    incl = jnp.tril(jnp.ones((C, C), bool))
    A = dot("...tk,...ik->...ti", k, k)
    P = jnp.where(incl, dot("...tk,...ik->...ti", q, k), 0.0)
    q_dec, k_dec, k_end = q, k, k
    e_kd = jnp.ones(k.shape[:-1] + (1,), jnp.promote_types(jnp.float32, k.dtype))  # k_dec = k e_kd
    decay = jnp.ones(k.shape[:-2] + (1,), k.dtype)
  else:
    ax = 1  # the C axis of [L, C, ...]
    bounded = g.ndim == 3 and g_lower_bound is not None and bounded_ok(C)
    dyadic = g.ndim == 3 and not bounded and CHANNEL_PAIR_DYADIC and dyadic_ok(C)
    mode = _sum_mode("head" if g.ndim == 2 else "bounded" if bounded else "dyadic" if dyadic else "pairwise")
    gam, to_end = _incl_sums(g, ax, mode=mode), _rev_excl_sums(g, ax, mode=mode)
    if g.ndim == 2:
      pair = functools.partial(_pair_scalar, dot=dot)
      A, P = (jax.checkpoint(pair) if PAIR_REMAT else pair)(q, k, g)
      gam, to_end, total = gam[..., None], to_end[..., None], gam[..., -1:]
    else:
      if bounded:
        A, P = _pair_channel_bounded(q, k, g, dot)
      else:
        exact = _pair_channel_dyadic if dyadic else _pair_channel
        pair = functools.partial(exact, dot=dot)
        A, P = (jax.checkpoint(pair) if CHANNEL_PAIR_REMAT else pair)(q, k, g)
      total = gam[..., -1, :]
    e_gam = jnp.exp(gam)
    q_dec, k_dec, k_end = q * e_gam, k * e_gam, k * jnp.exp(to_end)
    e_kd = e_gam if g.ndim == 2 else None  # per row: k_dec = k e_kd (SOLVE_BETA_VJP)
    decay = jnp.exp(total)
  if masks is not None:
    same, carries, reaches_end, unbroken = masks
    P = jnp.where(same, P, 0.0)
    A = jnp.where(same, A, 0.0)
    q_dec = jnp.where(carries[..., None], q_dec, 0.0)
    k_dec = jnp.where(carries[..., None], k_dec, 0.0)
    e_kd = None if e_kd is None else jnp.where(carries[..., None], e_kd, 0.0)
    k_end = jnp.where(reaches_end[..., None], k_end, 0.0)
    decay = jnp.where(unbroken, decay, 0.0)
  out = lambda A, W, U: Local(*(x.astype(odt) for x in (q_dec, k_dec, k_end)), decay, P.astype(odt), A,
                             None if W is None else W.astype(odt), U.astype(odt))
  if beta_kind == "none":
    return out(None, None, v), None
  A = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), A, 0.0)
  if beta_kind == "channel":
    return out(A, None, v), None
  b = beta[..., None]
  # The solve's operand dtype: 16-bit inputs' with LOWP_SOLVE, else None (as computed: float32 or float64).
  sdt = odt if LOWP_SOLVE and solver == "blocked" and jnp.dtype(odt).itemsize == 2 else None
  if sdt is not None:
    # W and U as two products with the 16-bit T, each rounded to 16 bits where it is made: no [L, C, K + V]
    # right-hand side to concatenate, and in the backward no float32 [L, C, K + V] cotangent of the joint result
    # (the sum of its two slices' padded cotangents, the largest buffer at the layer's peak on the card).
    T = invert_unit_lower(b * A, prec, dtype=sdt)
    if SOLVE_BETA_VJP and e_kd is not None:
      W, U = _solve_apply(prec, T, beta, k, e_kd, v)
    else:
      W, U = (_apply_lowp(prec, T, (b * x).astype(sdt)) for x in (k_dec, v))
    return out(A, W, U), T
  rhs = jnp.concatenate([b * k_dec, b * v], axis=-1)
  T = None
  if solver == "blocked":
    T = invert_unit_lower(b * A, prec)
    X = mm("...ti,...ix->...tx", T, rhs, precision=prec)
  else:
    X = solve_unit_lower(b * A, rhs)
  K = k.shape[-1]
  return out(A, X[..., :K], X[..., K:]), T


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply_lowp(prec, T, R):
  """T R [.., C, X] for 16-bit T [.., C, C] and R [.., C, X]: accumulated in float32, returned in their dtype
  (LOWP_SOLVE's W and U). Its VJP takes the 16-bit cotangent as it comes: dT = dY R^T and dR = T^T dY are 16-bit
  products accumulating in float32, each written in the layout it is returned in. (Autodiff would widen dY to
  float32, multiply float32 by 16-bit operands, and form T^T dY as [.., X, C] and then transpose it.)"""
  return mm("...ti,...ix->...tx", T, R, precision=prec).astype(R.dtype)


def _apply_lowp_fwd(prec, T, R):
  return _apply_lowp(prec, T, R), (T, R)


def _apply_lowp_bwd(prec, res, dY):
  T, R = res
  dY = dY.astype(R.dtype)
  dT = mm("...tx,...ix->...ti", dY, R, precision=prec).astype(T.dtype)
  dR = mm("...ti,...tx->...ix", T, dY, precision=prec).astype(R.dtype)
  return dT, dR


_apply_lowp.defvjp(_apply_lowp_fwd, _apply_lowp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _solve_apply(prec, T, beta, k, e, v):
  """(W, U) = (T (beta k_dec), T (beta v)), k_dec = k e, in T's 16-bit dtype (SOLVE_BETA_VJP): T [.., C, C], beta
  [.., C], k [.., C, K] and v [.., C, V] (T's dtype), e [.., C, 1] the per-row decay (float32; zero where a reset
  cuts the row). Each right-hand side rounded to T's dtype as `_apply_lowp`'s: the same values as W, U there."""
  b = beta[..., None]
  return tuple(mm("...ti,...ix->...tx", T, x.astype(T.dtype), precision=prec).astype(T.dtype)
               for x in (b * (k * e), b * v))


def _solve_apply_fwd(prec, T, beta, k, e, v):
  return _solve_apply(prec, T, beta, k, e, v), (T, beta, k, e, v)


def _solve_apply_bwd(prec, res, cts):
  """With dX = (dW, dU) in T's dtype: G[t, i] = (dW k^T)[t, i] e_i + (dU v^T)[t, i] (each product's float32 sums
  rounded to T's dtype where it is made, as `_apply_lowp`'s dT), dT = G Diag(beta), dbeta_i = sum_t T[t, i] G[t, i];
  with dR = T^T dX (likewise rounded): dk = Diag(beta e) dR_w, de_i = beta_i sum_k dR_w[i, k] k[i, k],
  dv = Diag(beta) dR_u."""
  T, beta, k, e, v = res
  dW, dU = (c.astype(T.dtype) for c in cts)
  lp = lambda spec, x, y: mm(spec, x, y, precision=prec).astype(T.dtype)
  cdt = jnp.promote_types(jnp.float32, T.dtype)
  f = lambda x: x.astype(cdt)
  col = lambda x: jnp.swapaxes(x, -1, -2)  # [.., C, 1] -> [.., 1, C]: scales column i by x_i
  b = f(beta)[..., None]
  G = f(lp("...tx,...ix->...ti", dW, k)) * col(e) + f(lp("...tx,...ix->...ti", dU, v))
  dT = (G * col(b)).astype(T.dtype)
  dbeta = jnp.sum(f(T) * G, axis=-2).astype(beta.dtype)
  dRw, dRu = f(lp("...ti,...tx->...ix", T, dW)), f(lp("...ti,...tx->...ix", T, dU))
  dk = (dRw * (b * e)).astype(k.dtype)
  de = (b * jnp.sum(dRw * f(k), axis=-1, keepdims=True)).astype(e.dtype)
  return dT, dbeta, dk, de, (dRu * b).astype(v.dtype)


_solve_apply.defvjp(_solve_apply_fwd, _solve_apply_bwd)


def _cumsum_excl(x, axis):
  """sum_{j < t} x_j along `axis`, as a direct sum (no subtraction)."""
  return jnp.flip(_cumsum_rev_excl(jnp.flip(x, axis), axis), axis)


def _cumsum_rev_incl(x, axis):
  """sum_{j >= t} x_j along `axis`."""
  return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis=axis), axis)


def _segsum_vjp(dS):
  """The VJP of `_segsum` over the last two axes: dS [.., t, i] -> dg [.., j] = sum_{t >= j > i} dS_ti, each
  a direct sum over the pairs whose span holds j (no difference of cumulative sums)."""
  C = dS.shape[-1]
  from_j = _cumsum_rev_incl(dS, dS.ndim - 2)  # [.., j, i]: sum_{t >= j} dS_ti
  return jnp.sum(jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), from_j, 0.0), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_own_vjp(prec, q, k, v, g, beta, masks):
  """`local` for a per-head decay g [L, C] and a per-head beta [L, C] (blocked solver), with the VJP `_local_bwd`."""
  return _local(q, k, v, g, beta, masks, beta_kind="head", prec=prec, solver="blocked")[0]


def _local_fwd(prec, q, k, v, g, beta, masks):
  """Saves the inputs (q, k, v in their 16-bit or float32 dtype, g, beta, the boolean masks) and the inverse T
  [L, C, C] (float32; 16-bit with LOWP_SOLVE and 16-bit inputs), nothing else: T is the one intermediate that costs
  more than a matmul to remake (the blocked substitution); the decays (elementwise), A and P (k k^T, q k^T: one
  [C, C, K] matmul each) are recomputed, which keeps two float32 [L, C, C] and every float32 [L, C, K] intermediate
  out of memory."""
  loc, T = _local(q, k, v, g, beta, masks, beta_kind="head", prec=prec, solver="blocked")
  return loc, (q, k, v, g, beta, masks, T)


def _local_bwd(prec, res, ct):
  """The VJP of `local`'s eight outputs (per-head decay and beta) from the saved inputs and T.

  Forward, per chunk: gamma_t = sum_{j <= t} g_j, to_end_i = sum_{j > i} g_j, D_ti = e^{sum_{i < j <= t} g_j}
  (i <= t, else 0); A = strictly-lower(k k^T * D), P = q k^T * D, both masked by `same`; q_dec, k_dec = q, k *
  e^gamma (masked by carries), k_end = k e^to_end (reaches_end), decay = e^{gamma_C} (unbroken); R = [Diag(beta)
  k_dec, Diag(beta) v], M = I + Diag(beta) A, T = M^{-1}, [W, U] = T R. With dX = [dW, dU]:
    dT = dX R^T;  dM = -T^T dT T^T (strictly lower: `_invert_unit_lower_bwd`);  dR = T^T dX = [dR_w, dR_u];
    dA = same * (Diag(beta) dM + strictly-lower(dA_out));  dP = same * dP_out;  dKK = dA D;  dQK = dP D;
    dbeta = rowsum(dM * A) + rowsum(dR_w * k_dec) + rowsum(dR_u * v);  dv = Diag(beta) dR_u;
    dk_dec = carries * (dk_dec_out + Diag(beta) dR_w);  dq_dec = carries * dq_dec_out;  dk_end = reaches * dk_end_out;
    dq = dq_dec e^gamma + dQK k;  dk = dk_dec e^gamma + dk_end e^to_end + dQK^T q + (dKK + dKK^T) k;
    dgamma = rowsum(dq_dec * q_dec) + rowsum(dk_dec * k_dec);  dto_end = rowsum(dk_end * k_end);
    dtotal = unbroken * ddecay * e^{gamma_C};  dlogD = dA * A + dP * P (what reaches the pairwise log-decays);
    dg_j = sum_{t >= j} dgamma_t + sum_{i < j} dto_end_i + dtotal + sum_{t >= j > i} dlogD_ti.
  (`pallas_local._bwd_kernel`'s derivation, with the cotangents of k_dec, A and decay and the segment masks.)
  Every exponent is the forward's (<= 0); dg's sums are direct sums over the spans, never differences.
  The matmuls of k, q, v with a 16-bit operand (k k^T's and q k^T's transposes, and dT from the cotangents of W and
  U, which are 16-bit and whose products are exact in float32) take the inputs' dtype; those with T float32; all
  accumulate in float32, at `prec`; XLA fuses the elementwise work."""
  # Tied to the cotangents (as `jax.checkpoint` does it), so that XLA can neither merge the recomputed k k^T, q k^T
  # and decays with the forward's (which would keep them alive through the state pass) nor hoist them. XLA:CPU
  # drops the barrier (docs/benchmarks.md, LOCAL_VJP): there the backward forms no float32 [C, K] copy to hoist.
  res, ct = jax.lax.optimization_barrier((res, ct))
  q, k, v, g, beta, masks, T = res
  cdt, odt = jnp.promote_types(jnp.float32, T.dtype), k.dtype
  dot = _dot(prec)
  C = k.shape[-2]
  incl = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  same, carries, reaches_end, unbroken = (None,) * 4 if masks is None else masks
  keep = lambda m, x: x if m is None else jnp.where(m, x, 0.0)
  row = lambda m: None if m is None else m[..., None]
  f = lambda x: x.astype(cdt)
  gam = _cumsum_incl(g, 1)
  e_gam = jnp.exp(gam)[..., None]
  e_end = jnp.exp(_cumsum_rev_excl(g, 1))[..., None]
  D = jnp.exp(jnp.where(incl, _segsum(g, 1, mode=_sum_mode("head")), -jnp.inf))
  A = keep(same, jnp.where(strict, dot("...tk,...ik->...ti", k, k) * D, 0.0))
  P = keep(same, dot("...tk,...ik->...ti", q, k) * D)
  e_kd = keep(row(carries), e_gam)  # k_dec = k e_kd
  b = beta[..., None]
  # The solve, [W, U] = T R: dT = (dW k_dec^T + dU v^T) Diag(beta), from k, v and the cotangents of W, U as they
  # are (their dtype: 16-bit products are exact in float32), the decays and beta applied to the [C, C] result;
  # no float32 copy of R is formed, and its key and value halves stay apart.
  col = lambda x: jnp.swapaxes(x, -1, -2)
  dT = (dot("...tk,...ik->...ti", ct.W, k) * col(e_kd) + dot("...tv,...iv->...ti", ct.U, v)) * col(b)
  dM = _inverse_ct(T, dT, prec, cdt)
  dRw, dRu = dot("...ti,...tk->...ik", T, f(ct.W)), dot("...ti,...tv->...iv", T, f(ct.U))
  dbeta = (jnp.sum(dM * A, axis=-1) + jnp.sum(dRw * k, axis=-1) * e_kd[..., 0] + jnp.sum(dRu * v, axis=-1))
  # The pairwise products and decays.
  dA = keep(same, b * dM + jnp.where(strict, f(ct.A), 0.0))
  dP = keep(same, f(ct.P))
  dKK, dQK = dA * D, dP * D
  dlogD = dA * A + dP * P
  dKs = (dKK + jnp.swapaxes(dKK, -1, -2)).astype(odt)
  dQK = dQK.astype(odt)
  # The decayed keys and queries.
  dqd = keep(row(carries), f(ct.q_dec))
  dkd = keep(row(carries), f(ct.k_dec) + b * dRw)
  dke = keep(row(reaches_end), f(ct.k_end))
  dq = dqd * e_gam + dot("...ti,...ik->...tk", dQK, k)
  dk = (dkd * e_gam + dke * e_end + dot("...ti,...tk->...ik", dQK, q) + dot("...ti,...ik->...tk", dKs, k))
  dgam = (jnp.sum(dqd * q, axis=-1) + jnp.sum(dkd * k, axis=-1)) * e_gam[..., 0]
  dto_end = jnp.sum(dke * k, axis=-1) * e_end[..., 0]
  dtotal = keep(unbroken, f(ct.decay)) * jnp.exp(gam[..., -1:])
  dg = _cumsum_rev_incl(dgam, 1) + _cumsum_excl(dto_end, 1) + dtotal + _segsum_vjp(dlogD)
  return (dq.astype(q.dtype), dk.astype(k.dtype), (b * dRu).astype(v.dtype), dg.astype(g.dtype),
          dbeta.astype(beta.dtype), None)


_local_own_vjp.defvjp(_local_fwd, _local_bwd)


def local_vjp(prec, q, k, v, g, beta, T, ct: Local):
  """(dq, dk, dv, dg, dbeta): the VJP of `local` (per-head decay g [L, C] and beta [L, C], blocked solver, no
  segment masks) at its inputs, from the inverse T = (I + Diag(beta) A)^{-1} [L, C, C] and the cotangents `ct` of its
  eight outputs (zeros where an output is not used): LOCAL_VJP's backward, for a forward computed elsewhere
  (`pallas_local`'s kernels with SPLIT_VJP), which need keep only the inputs and T."""
  return _local_bwd(prec, (q, k, v, g, beta, None, T), ct)[:5]


def solve_unit_lower(L, rhs):
  """(I + L)^{-1} rhs for strictly lower-triangular L: forward substitution, exact for any L (a Neumann
  series in L overflows when keys inside a chunk are correlated)."""
  return jax.lax.linalg.triangular_solve(L, rhs, left_side=True, lower=True, unit_diagonal=True)


# invert_unit_lower's VJP: True, the inverse's own (two batched matmuls from the saved inverse); False, autodiff
# through the forward substitution (the chain of row updates, reversed). Read at trace time; a switch so that
# `experiments/bench_ops.py --switch intra_chunk.INVERSE_VJP=off,on` can time both in one process.
INVERSE_VJP = True
# The inverse's value (T from L, forward only; its VJP is INVERSE_VJP's, from T) through one Pallas kernel,
# `pallas_local.solve` (16 x 16 blocks, block forward substitution, as fla's solve_tril), in place of XLA's row
# updates (one a row of a 16-row block) and merges: True where it takes L (float32, C a power of two >= 16,
# blocks of 16 with INVERSE_VJP), on any backend (Pallas' interpreter off a GPU); False (today), XLA's. Both
# differentiated and forward-only calls of the XLA chunk-local stage use it, per-head and per-key-channel decay
# alike. Read at trace time. Off: in one call on an H100 (`results/benchmarks/h100_2026-12-06/solve_kernel.txt`),
# Gated DeltaNet's op 0.99-1.04x (forward) and 1.01-1.06x (forward+backward) the time without it at three shapes;
# KDA's 0.89x / 0.91x at (4, 2048, 16, 128) but 1.14x / 1.04x at (2, 16384, 16, 128).
SOLVE_KERNEL = False


def _inverse_value(L, prec, block, dtype):
  """T = (I + L)^{-1} in `dtype`: `pallas_local.solve` with SOLVE_KERNEL where it takes L, else XLA's."""
  if SOLVE_KERNEL and INVERSE_VJP and block == 16:
    from gdn.ops import pallas_local  # it imports this module
    if pallas_local.solve_supports(L):
      return pallas_local.solve(L, prec, dtype)
  return _invert_unit_lower(L, prec, block).astype(dtype)


def invert_unit_lower(L, prec, block: int = 16, dtype=None):
  """(I + L)^{-1} [.., C, C] for strictly lower-triangular L, by forward substitution inside diagonal blocks
  of `block` rows, then merging pairs of diagonal blocks with matmuls:
  [[A, 0], [X, D]]^{-1} = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]. Exact algebra, like a triangular solve, but
  made of batched matmuls, which is what GPUs run fast. Computed in L's dtype, returned in `dtype` (None: L's).

  With INVERSE_VJP its VJP is the inverse's own, dL = -T^T dT T^T on the strictly lower triangle (the only
  entries read): two batched matmuls from the saved T (the returned one, so a 16-bit `dtype` saves it in 16 bits),
  instead of differentiating the forward substitution's row-by-row updates, which autodiff turns into a chain of
  small kernels as long as the block."""
  dtypes = (jnp.dtype(L.dtype), jnp.dtype(L.dtype if dtype is None else dtype))
  if INVERSE_VJP:
    return _inverse_own_vjp(L, prec, block, dtypes)
  return _invert_unit_lower(L, prec, block).astype(dtypes[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _inverse_own_vjp(L, prec, block, dtypes):
  return _inverse_value(L, prec, block, dtypes[1])


def _invert_unit_lower_fwd(L, prec, block, dtypes):
  T = _inverse_value(L, prec, block, dtypes[1])
  return T, T


def _invert_unit_lower_bwd(prec, block, dtypes, T, dT):
  return (_inverse_ct(T, dT, prec, dtypes[0]),)


def _inverse_ct(T, dT, prec, dtype):
  """The inverse's VJP from T = (I + L)^{-1} and its cotangent: dL = -T^T dT T^T on the strictly lower triangle,
  in `dtype`; a 16-bit T (and dT) is widened to float32 first, so the products accumulate there."""
  C = T.shape[-1]
  cdt = jnp.promote_types(jnp.float32, T.dtype)
  T = T.astype(cdt)
  dL = -jnp.einsum("...ji,...jk,...lk->...il", T, dT.astype(cdt), T, precision=prec)
  return jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), dL, 0.0).astype(dtype)


_inverse_own_vjp.defvjp(_invert_unit_lower_fwd, _invert_unit_lower_bwd)


def _invert_unit_lower(L, prec, block):
  C = L.shape[-1]
  s = block if C % block == 0 and (C // block) & (C // block - 1) == 0 else C
  lead = L.shape[:-2]
  nb = C // s
  # Diagonal blocks [.., nb, s, s]: row r of the inverse is e_r - sum_{j<r} L_rj T_j.
  Lb = L.reshape(lead + (nb, s, nb, s))
  Ld = jnp.einsum("...bibj->...bij", Lb) if nb > 1 else Lb[..., 0, :, 0, :][..., None, :, :]
  T = jnp.broadcast_to(jnp.eye(s, dtype=L.dtype), Ld.shape)
  for r in range(1, s):
    row = jnp.eye(s, dtype=L.dtype)[r] - jnp.einsum("...j,...jk->...k", Ld[..., r, :r], T[..., :r, :],
                                                     precision=prec)
    T = T.at[..., r, :].set(row)
  # Merge pairs of diagonal blocks until one block spans the chunk.
  while T.shape[-3] > 1:
    m, w = T.shape[-3] // 2, T.shape[-1]
    Lw = L.reshape(lead + (2 * m, w, 2 * m, w))
    A, D = T[..., 0::2, :, :], T[..., 1::2, :, :]
    X = jnp.stack([Lw[..., 2 * i + 1, :, 2 * i, :] for i in range(m)], axis=-3)
    off = -jnp.einsum("...ij,...jk,...kl->...il", D, X, A, precision=prec)
    top = jnp.concatenate([A, jnp.zeros_like(A)], axis=-1)
    bottom = jnp.concatenate([off, D], axis=-1)
    T = jnp.concatenate([top, bottom], axis=-2)
  return T[..., 0, :, :]


def check_groups(local_groups) -> int:
  """`local_groups` validated: a positive int (None: LOCAL_GROUPS, read now)."""
  groups = LOCAL_GROUPS if local_groups is None else local_groups
  if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
    raise ValueError(f"local_groups must be a positive int (1: the chunk-local backward over all chunks at once), "
                     f"got {groups!r}")
  return int(groups)


def grouped(local_fn, groups: int):
  """`local_fn` (`local`'s signature, or a function of it such as `pallas_local.local`) with its backward run
  over `groups` groups of chunks; `local_fn` itself when groups is 1.

  A `jax.custom_vjp`: its primal (forward-only calls) is `local_fn` on all chunks at once, as before (its fused
  kernel where it has one). Differentiated, the L chunks are padded to G groups of ceil(L / G) (zero chunks, masks
  off) and the forward runs group after group (a `lax.map`, `local_fn`'s primal on each), keeping only the inputs;
  the backward, group after group again, recomputes the group's forward and applies its VJP. So the float32
  [C, C] and [C, K] intermediates, and their cotangents, exist for one group at a time. Every chunk's arithmetic is
  the ungrouped one's, so the values are too, to float32 rounding. k_dec and A, which only the per-value-channel
  solve reads, are left out (None) for the other variants, so no zero cotangent of theirs is made."""
  if groups == 1:
    return local_fn

  def run(q, k, v, g, beta, masks, *, beta_kind: str, prec, solver: str = "blocked") -> Local:
    def fn(xs, masks):
      loc = local_fn(*xs, masks, beta_kind=beta_kind, prec=prec, solver=solver)
      return loc if beta_kind == "channel" else dataclasses.replace(loc, k_dec=None, A=None)

    L = q.shape[0]
    n = -(-L // groups)
    split = lambda x: jnp.pad(x, [(0, n * groups - L)] + [(0, 0)] * (x.ndim - 1)).reshape((groups, n) + x.shape[1:])
    merge = lambda x: x.reshape((n * groups,) + x.shape[2:])[:L]

    def fwd(xs, masks):
      # Differentiated: the forward group by group too, so its float32 temporaries exist for one group at a time.
      out = jax.lax.map(lambda a: fn(*a), jax.tree.map(split, (xs, masks)))
      return jax.tree.map(merge, out), (xs, masks)

    def bwd(res, ct):
      xs, masks = res
      # every output's dtype (a cotangent may come back wider), before the split: 16-bit groups, not float32
      ct = jax.tree.map(lambda c, o: c.astype(o.dtype), ct, jax.eval_shape(fn, xs, masks))

      def one(args):
        xs_g, masks_g, ct_g = args
        return jax.vjp(lambda xs: fn(xs, masks_g), xs_g)[1](ct_g)[0]

      return jax.tree.map(merge, jax.lax.map(one, jax.tree.map(split, (xs, masks, ct)))), None

    call = jax.custom_vjp(fn)
    call.defvjp(fwd, bwd)
    return call((q, k, v, g, beta), masks)

  return run
