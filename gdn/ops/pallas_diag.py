"""The diagonal sub-chunk blocks of the exact per-key-channel chunk-local stage (KDA) as Pallas kernels, forward
and backward: what `intra_chunk._pair_channel_dyadic` takes from them with `intra_chunk.CHANNEL_DIAG_KERNEL`.

Shapes: R sub-chunks (one flat axis: every chunk's C / c of them), c = SUB sub-chunk size, K key dim, Kp the
padded K (a power of two, at least 16).

For one sub-chunk with queries q, keys k and log-decays g [c, K] (every g <= 0), the blocks are

    A[t, j] = sum_k k_tk k_jk e^{E_tjk} (t > j),   P[t, j] = sum_k q_tk k_jk e^{E_tjk} (t >= j),
    E_tjk = sum_{j < l <= t} g_lk,

the pairs whose decay spans no sub-chunk boundary: the dyadic levels below SUB of `_pair_channel_dyadic`, which
XLA runs as four rounds of small batched matmuls, exponentials and block assemblies over the whole [L, C, K]
layout. Here one program takes one sub-chunk (or, with BLOCK_K, one slice of its keys) and loops over its c
columns j: E for column j is a running sum over the columns in descending order (RUNNING_SUMS; or a cumulative
sum over t of the log-decays after j, `where(l > j, g, 0)`), a sum of non-positive terms, so exact whatever the
gates (no e^{+x}, no difference of two long sums, as `intra_chunk` requires), then one exponential and two
reductions over the keys; everything in float32 registers, the inputs read once. This is the token-parallel idea
of fla's `chunk_kda_fwd_kernel_intra_token_parallel` (whose exponents are differences of the chunk's cumulative
sums), with gdn's exact span sums.

Backward, same loop (with BWD_BLOCK_K, its grid over slices of the keys): with w_t = dA_tj k_t + dP_tj q_t and
Z_t = w_t k_j e^{E_tj} (t > j), dq_t += dP_tj k_j e^{E_tj}, dk_t += dA_tj k_j e^{E_tj}, dk_j += sum_t w_t e^{E_tj};
and the log-decay g_l, which every pair j < l <= t spans, gets dg_l = sum_{t >= l} (R_t - Cc_t),
R_t = sum_j Z_tj (row t's pairs) and Cc_t = sum_i Z_it (column t's pairs): the pairs of the rows from l on, less
those that start at or after l. That last sum runs inside the kernel as a product with the 0/1 matrix [t >= l],
at float32 precision.

Triton constraints kept, as `pallas_local`'s: power-of-two blocks, static ref slices, no slicing of loaded values,
no reverse cumulative sums (Pallas' Triton lowering has none), 2-D dots of at least 16 along every dimension.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops.pallas_common import batched_rows, default_interpret, kernel_precision, per_rows, pow2

SUB = 16  # the sub-chunk: the blocks' rows and columns (Triton's smallest dot dimension)
# The kernels' settings, all read at trace time and timed by `experiments/bench_diag.py`; the defaults are the
# fastest of its H100 runs of 2026-12-06 at (4, 2048, 16, 128) and (2, 16384, 16, 128)
# (results/benchmarks/h100_2026-12-06/kda_diag_settings*.txt): forward 0.31 and 0.89 ms against 1.12 ms (first
# shape) for the first version (scans, 4 warps), backward 0.56 and 1.80 ms against 1.27.
#
# Warps of the forward and backward programs (one [SUB, Kp] tile each: at Kp = 128, 2,048 float32 elements).
NUM_WARPS = 8
BWD_NUM_WARPS = 4
# How a column's exponents are formed: True, running sums with the columns in descending order,
# E_j = where(t > j, E_{j+1} + g_{j+1}, 0) (row j + 1 of g read from the ref): no scan across the tile's rows, one
# add and one select a column; False (the first version), a cumulative sum over the rows of `where(l > j, g_l, 0)`
# for each column j. Both are sums of the same non-positive terms (exact for any g), in another order.
RUNNING_SUMS = True
# The keys each program takes: None, all Kp of them (one program per sub-chunk); or a power of two >= 16 below Kp,
# a grid of (sub-chunk, slice of keys). The backward has no sum over the keys, so its slices are independent
# programs with smaller tiles; the forward's A and P are sums over the keys, so each slice writes its partial
# blocks and XLA adds the Kp / BLOCK_K of them. Slices of 32 or 64 keys were not faster than all of them at the
# warps above (they were at 2 and 4 forward warps, and at 8 backward warps).
BLOCK_K: Optional[int] = None
BWD_BLOCK_K: Optional[int] = None
# The backward's sums over the rows of a column (dk's column part, dk_j += sum_t w_t e^{E_tj}, and dg's column
# pairs): False, reduced across the tile's rows at every column step (through shared memory where the rows are
# spread over warps); True, from a second loop over the rows t in ascending order whose tile is indexed by the
# columns j, with running sums E^(t)_j = where(j < t, E^(t-1)_j + g_t, 0): every sum elementwise, no reduction
# across the rows, for a second exponential a pair (its first loop takes running sums whatever RUNNING_SUMS).
# Both are sums of the same terms, in another order. Off: on an H100 the two loops were 1.32x and 1.39x slower
# at 4 warps (h100_2026-12-06/kda_diag_two_loops.txt); they helped only the slower 8-warp backward.
BWD_ROW_LOOP = False


def _iota(shape, axis):
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _columns(g, g_ref, running: bool):
  """(j, E) for every column j, E [c, Kp] the exponents E_t = sum_{j < l <= t} g_l (0 for t <= j): each a cumulative
  sum over the rows (j ascending), or with `running` a running sum (j descending, RUNNING_SUMS)."""
  shape = g_ref.shape
  c = shape[0]
  row = _iota(shape, 0)
  if not running:
    for j in range(c):
      yield j, jax.lax.cumsum(jnp.where(row > j, g, 0.0), axis=0)
    return
  E = jnp.zeros(shape, jnp.float32)
  for j in range(c - 1, -1, -1):
    if j < c - 1:
      E = jnp.where(row > j, E + g_ref[pl.ds(j + 1, 1), :].astype(jnp.float32), 0.0)
    yield j, E


def _fwd_kernel(q_ref, k_ref, g_ref, a_ref, p_ref, *, running):
  c = k_ref.shape[0]
  f32 = jnp.float32
  q, k, g = (r[...].astype(f32) for r in (q_ref, k_ref, g_ref))
  col = _iota((c, c), 1)
  A = P = jnp.zeros((c, c), f32)
  for j, E in _columns(g, g_ref, running):
    kj = k_ref[pl.ds(j, 1), :].astype(f32)  # [1, Kp]
    f = kj * jnp.exp(E)  # [c, Kp]: k_j e^{E_tj} for every row t
    A = jnp.where(col == j, jnp.sum(k * f, axis=1)[:, None], A)
    P = jnp.where(col == j, jnp.sum(q * f, axis=1)[:, None], P)
  row = _iota((c, c), 0)
  a_ref[...] = jnp.where(row > col, A, 0.0)
  p_ref[...] = jnp.where(row >= col, P, 0.0)


def _bwd_kernel(q_ref, k_ref, g_ref, da_ref, dp_ref, dq_ref, dk_ref, dg_ref, *, exact, running):
  c, Kp = k_ref.shape
  f32 = jnp.float32
  q, k, g = (r[...].astype(f32) for r in (q_ref, k_ref, g_ref))
  row = _iota((c, Kp), 0)
  dq = dk = R = Cc = jnp.zeros((c, Kp), f32)
  for j, E in _columns(g, g_ref, running):
    kj = k_ref[pl.ds(j, 1), :].astype(f32)  # [1, Kp]
    a = jnp.where(_iota((c, 1), 0) > j, da_ref[:, pl.ds(j, 1)], 0.0)  # [c, 1]: dA_tj, t > j
    p = jnp.where(_iota((c, 1), 0) >= j, dp_ref[:, pl.ds(j, 1)], 0.0)  # dP_tj, t >= j
    e = jnp.exp(E)
    ke = kj * e
    dq = dq + p * ke
    dk = dk + a * ke
    we = (a * k + p * q) * e
    dk = dk + jnp.where(row == j, jnp.sum(we, axis=0, keepdims=True), 0.0)
    Z = jnp.where(row > j, we * kj, 0.0)  # the diagonal pair t = j spans no log-decay
    R = R + Z
    Cc = Cc + jnp.where(row == j, jnp.sum(Z, axis=0, keepdims=True), 0.0)
  later = (_iota((c, c), 1) >= _iota((c, c), 0)).astype(f32)  # [l, t]: t >= l
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dims = (((1,), (0,)), ((), ()))
  dg_ref[...] = jax.lax.dot_general(later, R - Cc, dims, precision=exact,
                                    preferred_element_type=f32).astype(dg_ref.dtype)


def _bwd_two_loops_kernel(q_ref, k_ref, g_ref, da_ref, dp_ref, dat_ref, dpt_ref, dq_ref, dk_ref, dg_ref, *, exact):
  """`_bwd_kernel` (running sums) with its sums over the rows moved into a loop of their own (BWD_ROW_LOOP); dat_ref
  and dpt_ref hold dA and dP transposed, so that a row t of them is read as a column over j. Both loops are
  `fori_loop`s: unrolled, Triton hoists every row's loads and holds them (offline for sm_90, 255 registers and
  spills at 8 warps, against 187 and 175 at 4 and 8 warps as loops)."""
  c, Kp = k_ref.shape
  f32 = jnp.float32
  q, k = (r[...].astype(f32) for r in (q_ref, k_ref))
  row = _iota((c, Kp), 0)
  col1 = _iota((c, 1), 0)
  row_of = lambda ref, i: ref[pl.ds(i, 1), :].astype(f32)  # [1, Kp]

  def by_rows(t, carry):
    # tile rows j, row t of the sub-chunk: S_j = sum_{t >= j} w_t e^{E_tj} (dk's column part) and the same over
    # t > j (column j's pairs, whose sum for dg is k_j times it), E_tj a running sum over t
    S, S_off, E = carry
    E = jnp.where(row < t, E + row_of(g_ref, t), 0.0)  # all zero at t = 0
    a = jnp.where(col1 < t, dat_ref[:, pl.ds(t, 1)], 0.0)  # dA_tj, j < t
    p = jnp.where(col1 <= t, dpt_ref[:, pl.ds(t, 1)], 0.0)  # dP_tj, j <= t
    w = (a * row_of(k_ref, t) + p * row_of(q_ref, t)) * jnp.exp(E)
    return S + w, S_off + jnp.where(row < t, w, 0.0), E

  def by_columns(i, carry):
    # tile rows t, column j = c - 1 - i: dq, dk's row part, and R (row t's pairs), E a running sum over the
    # columns in descending order as in `_columns`
    dq, dk, R, E = carry
    j = c - 1 - i
    E = jnp.where(row > j, E + row_of(g_ref, jnp.minimum(j + 1, c - 1)), 0.0)  # all zero at j = c - 1
    a = jnp.where(col1 > j, da_ref[:, pl.ds(j, 1)], 0.0)  # dA_tj, t > j
    p = jnp.where(col1 >= j, dp_ref[:, pl.ds(j, 1)], 0.0)  # dP_tj, t >= j
    ke = row_of(k_ref, j) * jnp.exp(E)
    return dq + p * ke, dk + a * ke, R + jnp.where(row > j, (a * k + p * q) * ke, 0.0), E

  zero = jnp.zeros((c, Kp), f32)
  S, S_off, _ = jax.lax.fori_loop(0, c, by_rows, (zero, zero, zero))
  # the second loop starts from the first's sums, so that only its own four tiles are carried: dk from dk's
  # column part, and R - Cc from -Cc
  dq, dk, D, _ = jax.lax.fori_loop(0, c, by_columns, (zero, S, -k * S_off, zero))
  later = (_iota((c, c), 1) >= _iota((c, c), 0)).astype(f32)  # [l, t]: t >= l
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dims = (((1,), (0,)), ((), ()))
  dg_ref[...] = jax.lax.dot_general(later, D, dims, precision=exact,
                                    preferred_element_type=f32).astype(dg_ref.dtype)


def supported(C: int, dtype) -> bool:
  """Whether a chunk of C positions splits into whole sub-chunks (C a multiple of SUB) and the dtype is one the
  kernels take (16 or 32 bits)."""
  return C >= SUB and C % SUB == 0 and jnp.dtype(dtype).itemsize in (2, 4)


def _pad_k(x, Kp):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Kp - x.shape[-1])])


def _flat(q, k, g):
  """q, k, g [.., C, K] as [R, SUB, Kp] (zero keys and log-decays in the padding change nothing)."""
  K = k.shape[-1]
  Kp = pow2(K)
  return tuple(_pad_k(x, Kp).reshape(-1, SUB, Kp) for x in (q, k, g))


def _block_k(Kp: int, setting: Optional[int]) -> int:
  """The keys a program takes for a BLOCK_K / BWD_BLOCK_K setting at padded width Kp."""
  if setting is None or setting >= Kp:
    return Kp
  if setting < SUB or setting & (setting - 1):
    raise ValueError(f"pallas_diag: a key block must be a power of two >= {SUB}, got {setting}")
  return setting


def _keys_spec(bk):
  """[R, SUB, Kp] inputs and outputs, block (sub-chunk i, key slice j)."""
  return pl.BlockSpec((None, SUB, bk), lambda i, j: (i, 0, j))


def _blocks_spec():
  """[R, SUB, SUB] inputs (the cotangents), the same block for every key slice."""
  return pl.BlockSpec((None, SUB, SUB), lambda i, j: (i, 0, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def diag_blocks(q, k, g, interpret: bool):
  """(A, P) [.., C / SUB, SUB, SUB] float32: the diagonal sub-chunk blocks (module docstring) for q, k, g
  [.., C, K] (q already scaled; C a multiple of SUB); A strictly lower, P lower with its diagonal q_t . k_t.
  Gradients: `_bwd_kernel`, or `_bwd_two_loops_kernel` with BWD_ROW_LOOP (its cotangents in q's, k's and g's
  dtypes). interpret: Pallas' interpreter."""
  return _forward(q, k, g, interpret)


def _forward(q, k, g, interpret):
  lead, C = k.shape[:-2], k.shape[-2]
  qf, kf, gf = _flat(q, k, g)
  static = (interpret, _block_k(kf.shape[-1], BLOCK_K), RUNNING_SUMS, NUM_WARPS)  # the settings, read now
  A, P = batched_rows(_FORWARD, static, qf, kf, gf)
  shape = lead + (C // SUB, SUB, SUB)
  return A.sum(1).reshape(shape), P.sum(1).reshape(shape)


def _forward_rows(static, qf, kf, gf):
  """The forward kernel on [R, SUB, Kp] rows: each key slice's partial (A, P) [R, Kp / bk, SUB, SUB]."""
  interpret, bk, running, num_warps = static
  R, _, Kp = kf.shape
  out = jax.ShapeDtypeStruct((R, Kp // bk, SUB, SUB), jnp.float32)
  part = pl.BlockSpec((None, None, SUB, SUB), lambda i, j: (i, j, 0, 0))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, running=running), grid=(R, Kp // bk),
      in_specs=[_keys_spec(bk)] * 3, out_specs=[part, part], out_shape=[out, out], interpret=interpret,
      name="gdn_channel_diag_blocks",
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))(qf, kf, gf)


# Under a multi-device jit each device runs the kernels on its own sub-chunks (`pallas_common.per_rows`).
_FORWARD = per_rows(_forward_rows)


def _diag_fwd(q, k, g, interpret):
  return _forward(q, k, g, interpret), (q, k, g)


def _diag_bwd(interpret, res, cts):
  q, k, g = res
  dA, dP = cts
  lead, (C, K) = k.shape[:-2], k.shape[-2:]
  qf, kf, gf = _flat(q, k, g)
  R, _, Kp = kf.shape
  dA, dP = (x.astype(jnp.float32).reshape(R, SUB, SUB) for x in (dA, dP))
  cts = (dA, dP, jnp.swapaxes(dA, 1, 2), jnp.swapaxes(dP, 1, 2)) if BWD_ROW_LOOP else (dA, dP)
  exact = kernel_precision(jax.lax.Precision.HIGHEST, interpret)
  static = (interpret, _block_k(Kp, BWD_BLOCK_K), bool(BWD_ROW_LOOP), RUNNING_SUMS, BWD_NUM_WARPS, exact)
  dq, dk, dg = batched_rows(_BACKWARD, static, qf, kf, gf, *cts)
  back = lambda d, x: d[..., :K].reshape(lead + (C, K)).astype(x.dtype)
  return back(dq, q), back(dk, k), back(dg, g)


def _backward_rows(static, qf, kf, gf, *cts):
  """The backward kernel on [R, SUB, Kp] rows: (dq, dk, dg) [R, SUB, Kp] float32."""
  interpret, bk, row_loop, running, num_warps, exact = static
  R, _, Kp = kf.shape
  if row_loop:
    kernel = functools.partial(_bwd_two_loops_kernel, exact=exact)
  else:
    kernel = functools.partial(_bwd_kernel, exact=exact, running=running)
  out = jax.ShapeDtypeStruct((R, SUB, Kp), jnp.float32)
  return pl.pallas_call(
      kernel, grid=(R, Kp // bk), in_specs=[_keys_spec(bk)] * 3 + [_blocks_spec()] * len(cts),
      out_specs=[_keys_spec(bk)] * 3, out_shape=[out, out, out], interpret=interpret,
      name="gdn_channel_diag_blocks_bwd",
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))(qf, kf, gf, *cts)


_BACKWARD = per_rows(_backward_rows)


diag_blocks.defvjp(_diag_fwd, _diag_bwd)


def reference(q, k, g):
  """diag_blocks' (A, P) in XLA from the pairwise exponents [.., M, c, c, K] (exact span sums, float32 or
  wider): what the kernels are checked against."""
  lead, (C, K) = k.shape[:-2], k.shape[-2:]
  M = C // SUB
  dt = jnp.promote_types(k.dtype, jnp.float32)
  qs, ks, gs = (x.astype(dt).reshape(lead + (M, SUB, K)) for x in (q, k, g))
  t, j = jnp.arange(SUB)[:, None], jnp.arange(SUB)[None, :]
  # E[.., m, t, j, :] = sum over l in (j, t] of g_l: the masked cumulative sum over l, for each j
  mask = (jnp.arange(SUB)[None, :, None] > jnp.arange(SUB)[:, None, None]).astype(dt)  # [j, l, 1]: l > j
  E = jnp.cumsum(gs[..., None, :, :] * mask, axis=-2)  # [.., m, j, t, K]
  E = jnp.swapaxes(E, -2, -3)  # [.., m, t, j, K]
  D = jnp.where((t >= j)[..., None], jnp.exp(E), 0.0)
  A = jnp.einsum("...tk,...jk,...tjk->...tj", ks, ks, D, precision=jax.lax.Precision.HIGHEST)
  P = jnp.einsum("...tk,...jk,...tjk->...tj", qs, ks, D, precision=jax.lax.Precision.HIGHEST)
  return jnp.where(t > j, A, 0.0), P


def use(flag: Optional[bool]) -> bool:
  """A switch's setting: True, False, or None = where the Pallas kernels compile (a GPU backend)."""
  return (not default_interpret()) if flag is None else bool(flag)
