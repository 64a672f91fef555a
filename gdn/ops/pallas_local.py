"""The chunk-local work of the chunkwise gated delta rule (`intra_chunk.local`) as one fused Pallas kernel, for a
per-head decay and a per-head beta (Gated DeltaNet), and with `FUSED_LOCAL_CHANNEL` for a per-key-channel decay
and a per-head beta (KDA); everything else goes to the XLA reference.

Shapes: L chunks (B * HV * N, one flat axis), C chunk size, K key dim, V value dim; Cp, Kp, Vp the padded C, K,
V (powers of two, at least 16); BK, BV the key and value channels one step of a program's loops reads; c = 16
the sub-chunk of the triangular inverse, M = Cp / c.

One program per chunk (grid (L,)), all chunks in parallel, as fla's chunk_scaled_dot_kkt + solve_tril +
recompute_w_u in one kernel (with `LOCAL_SPLIT`, as three: steps 1-2, 3 and 4). With g the chunk's log-decays [C]
and beta [C]:

  1. gamma_t = sum_{j <= t} g_j, to_end_i = sum_{j > i} g_j and D_ti = sum_{i < j <= t} g_j, each a sum of the
     log-decays over the span it covers (a cumulative sum over a masked [Cp, Cp]), exactly as `intra_chunk`
     does it: never a difference of two cumulative sums, which loses all precision after a strong decay.
  2. KK = k k^T and QK = q k^T over K blocks; A = strictly-lower(KK e^D), P = lower(QK e^D).
  3. T = (I + Diag(beta) A)^{-1}: forward substitution inside the M diagonal c x c blocks, all M at once as
     one [M, c, c] array (fla's solve_tril), then merging pairs of blocks, [[X, 0], [Y, Z]]^{-1} =
     [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]], as T <- T - T Y T with Y the masked sub-diagonal blocks (two [Cp, Cp]
     matmul pairs at C = 64), as `intra_chunk.invert_unit_lower`.
  4. W = T Diag(beta) k_dec and U = T Diag(beta) v over K and V blocks; q_dec and k_end on the way.

It returns the fields of `intra_chunk.Local` that the Pallas state pass and `chunk.finish` read (q_dec, k_end,
decay, P, W, U); k_dec and A are None. decay is computed in XLA (one exp per chunk, or per chunk and key channel).

Per-key-channel decay (g [C, K]: KDA) has its own kernel, `_channel_kernel`, behind the module switch
`FUSED_LOCAL_CHANNEL` (default False: `intra_chunk.local` takes that variant, as before; on an H100 the kernel took
1.05-1.12x XLA's stage, and the forward 1.8-1.9x that of the dyadic form with its diagonal kernels,
docs/benchmarks.md). Steps 3 and 4 are the same; steps 1 and 2 follow
`intra_chunk._pair_channel_dyadic`: the decay of a pair of positions differs per key channel, so A and P are no
longer k k^T and q k^T times one [Cp, Cp] decay. Each pair's decay is factored at the one dyadic boundary between
its two positions, per level as dense [C, C] work over blocks of key channels, both exponents <= 0, so no e^{+x}
overflows even at g = -1e4 (total forgetting).

Dots: the inputs' dtype for k k^T and q k^T and the per-key-channel kernel's off-diagonal blocks (the keys and
queries times their decays, rounded to it: bfloat16 operands for bfloat16 callers), float32 operands for the
inverse and W, U (its entries are float32 values; 16-bit for W and U with `LOWP_WU`), all accumulated in float32,
at `pallas_common.kernel_precision`
of the caller's precision: one TF32 pass on float32 operands for bfloat16 callers, as XLA's DEFAULT does it, and
3xTF32 for float32 callers. The elementwise work (decays, forward substitution) is float32.

Gradients: `jax.custom_vjp` whose forward rule, run when the op is differentiated, is the XLA reference's
(`intra_chunk.local` on the same inputs) with its VJP as residual, so only forward-only calls (evaluation,
prefill, generation) run the kernel. On the H200 the first version, kernel forward then the reference
recomputed in the backward, cost 2-4% more in forward+backward than XLA alone (docs/benchmarks.md); a training
step now runs exactly the XLA program. With `BACKWARD_KERNEL` on, the forward rule runs the kernel and saves its
inputs, and the backward rule runs `_bwd_kernel`, which recomputes the decays, A and T per chunk; with
`BACKWARD_SPLIT` also on, two kernels instead (`_split_backward`): the solve per chunk, then dq and dk per chunk
and block of keys from the [Cp, Cp] float32 T and dM it writes. With `LOCAL_SPLIT` and `SPLIT_VJP` on, the forward
rule runs the three split kernels and saves the inputs and T, and the backward rule is `intra_chunk.local_vjp`.

Triton constraints the kernel keeps (Pallas' interpreter checks none of them): power-of-two blocks, at least 16
along every dot dimension, 2-D dots, static slices of refs only, no slicing of loaded values (blocks are
picked with iota masks, `jnp.where` and reductions), no data-dependent Python control flow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops import intra_chunk
from gdn.ops.pallas_common import batched_rows, default_interpret, kernel_precision, per_rows, pow2

SUB = 16  # rows of the diagonal blocks inverted by forward substitution (Triton's smallest dot)
# Key and value channels per step of the K and V loops, and warps: at K = V = 128, bfloat16, C = 64, Triton 3.9
# for sm_90 gives the kernel 197 registers a thread and no spill with 128 and 4 warps; with 64 (two steps),
# 254; 8 warps, 254. `experiments/bench_local.py` times the alternatives on the card.
BLOCK_K = 128
BLOCK_V = 128
NUM_WARPS = 4
NUM_STAGES = 1
# The backward kernel (`_bwd_kernel`): False runs XLA's chunk-local forward and its `jax.vjp` when the op is
# differentiated (today's rule); True runs the fused forward kernel, saves only its inputs and runs the backward
# kernel. Read at the call (trace time), as FUSED_LOCAL is. Its blocks and warps: it holds three to five [Cp, Cp]
# float32 matrices at once; offline for sm_90 (Triton 3.9, bfloat16, C = 64, K = V = 128) it takes 255 registers
# a thread in every setting tried, with 236 bytes of spill stores at blocks of 32 and 8 warps, 552 at 64 and 8
# warps, 828 at 32 and 4 warps, 1104 at 64 and 4 warps. Off: on one H200 the stage's forward and backward with it
# took 1.45-1.66x XLA's at the first four benchmark shapes (local_bwd_kernel.txt; docs/benchmarks.md).
BACKWARD_KERNEL = False
BWD_BLOCK_K = 32
BWD_BLOCK_V = 32
BWD_NUM_WARPS = 8
# The backward as two kernels, as fla's prepare_wy_repr_bwd then chunk_bwd_dqkwg: with BACKWARD_KERNEL on, True runs
# `_bwd_solve_kernel` and `_bwd_dqk_kernel` in place of `_bwd_kernel` (`_split_backward`). The first, one program
# per chunk with BWD_BLOCK_K, BWD_BLOCK_V and BWD_NUM_WARPS, recomputes the decays, A and T and writes T and
# strictly-lower(dM) ([L, Cp, Cp] float32), dv and a share of dbeta; the second, one program per chunk and block of
# SPLIT_BLOCK_K keys with SPLIT_NUM_WARPS, dq, dk and the rest of dg and dbeta as dots of those with q, k and dW.
# Read at the call. Offline for sm_90 (Triton 3.9, bfloat16, C = 64, K = V = 128) neither spills: 247 and 194
# registers a thread at these settings (the first also none at blocks of 16 or 64 and 8 warps, or 32 and 4 warps;
# the second spills 740 bytes at 64 keys and 4 warps, 8 at 128 keys and 8 warps). Off: on one H200 the two
# kernels took 0.64-0.90x XLA's VJP at the two small benchmark shapes but 1.31-1.39x at the three large ones
# (local_bwd_split.txt; docs/benchmarks.md).
BACKWARD_SPLIT = False
SPLIT_BLOCK_K = 64
SPLIT_NUM_WARPS = 8
# Per-key-channel decay (KDA, g [L, C, K]) through `_channel_kernel`: False (today) sends it to
# `intra_chunk.local`, True to the kernel, in forward-only calls (a differentiated call runs XLA's stage and its
# VJP, as for a per-head decay; the backward kernel takes a per-head decay only). Read at the call. Off: on one
# H200 its first version (pairwise decays in 16-step sub-chunks) took 1.55x XLA's stage forward at (4, 2048, 16,
# 128) (`experiments/bench_local.py --decay channel`; docs/benchmarks.md); rebuilt on dyadic levels (2026-12-05),
# 1.05-1.12x XLA's stage on an H100 at three shapes (2026-12-06), still slower. CHANNEL_BLOCK_K, its key
# channels per step of its loop over key blocks, and CHANNEL_NUM_WARPS: offline for sm_90 (Triton 3.9, ptxas
# 13.4, bfloat16, C = 64, K = V = 128) 235 registers a thread and no spill at 16 keys and 8 warps; 2,360 bytes of
# spill stores at 32 and 8 (float32 callers spill: 1,648 bytes at 16 and 8).
FUSED_LOCAL_CHANNEL = False
CHANNEL_BLOCK_K = 16
CHANNEL_NUM_WARPS = 8
# W = T (Diag(beta) k_dec) and U = T (Diag(beta) v) in the forward kernels with 16-bit inputs: True rounds T and the
# right-hand sides to the inputs' dtype before the two products (16-bit tensor-core operands, float32 accumulation),
# the values `intra_chunk.LOWP_SOLVE` gives XLA's stage, which a differentiated call runs; False multiplies the
# float32 T by float32 right-hand sides (one TF32 pass for bfloat16 callers). float32 inputs are unaffected. Read at
# the call. On since 2026-12-06: the op's bfloat16 forward 0.92x and 0.85x at (2, 16384, 16, 128), 0.81x and 0.82x at
# (1, 8192, 96, 128), 1.00x and 0.98x at (4, 2048, 16, 128), in two calls on an H100
# (`results/benchmarks/h100_2026-12-06/local_lowp_wu.txt`, `local_lowp_wu_2.txt`).
LOWP_WU = True
# The per-head kernel as three kernels, as fla's chunk_scaled_dot_kkt, solve_tril and recompute_w_u: True runs
# `_pairs_kernel` (q_dec, k_end, P and Diag(beta) A, float32, to memory), `_solve_kernel` (T, in the inputs' 16-bit
# dtype with LOWP_WU, else float32) and `_apply_kernel` (W, U), each one program per chunk with the warps of
# SPLIT_FWD_WARPS; False (today) the one `_kernel`, whose [Cp, Cp] float32 work from the pair products to W and U
# shares one program and its registers. Offline for sm_90 (C = 64, K = V = 128, bfloat16, LOWP_WU on) the one
# kernel takes 182 registers a thread at 4 warps and 211 at 8 (two programs an SM, then one), the three 126, 128
# and 66 at 8 warps (`results/benchmarks/cpu_2026-12-06/local_split_resources.txt`; the solve by 16 x 16 blocks, as
# fla's solve_tril, where the one kernel's [Cp, Cp] merges took 167). They move Diag(beta) A and T
# through memory once more (24-32 KiB a chunk). Forward-only calls, as `_kernel`. Read at the call. Off: on an
# H100 the stage took 0.65 and 1.84 ms at (4, 2048, 16, 128) and (2, 16384, 16, 128) with warps (8, 8, 8) and 0.40
# and 1.14 ms with (4, 4, 4), against the one kernel's 0.30 and 0.83 (`h100_2026-12-06/local_split.txt`).
LOCAL_SPLIT = False
SPLIT_FWD_WARPS = (8, 8, 8)  # warps of `_pairs_kernel`, `_solve_kernel`, `_apply_kernel`
# A differentiated call with LOCAL_SPLIT (per-head decay; BACKWARD_KERNEL off): True runs the three kernels there too,
# keeps only the stage's inputs and T (from `_solve_kernel`), and takes `intra_chunk.local_vjp` as the backward
# (LOCAL_VJP's: it recomputes the decays, k k^T and q k^T as XLA matmuls); False (today) runs XLA's stage and its
# autodiff there. Read at the call. Off: on an H100 the op's forward+backward took 1.05x and 1.34x the default's
# time at the two shapes above (8 warps; 1.04x and 1.26x with 4), and one layer's training step (d_model 2048,
# 8 x 8192 tokens) 1.13x the time for 0.95x the memory (`h100_2026-12-06/local_split.txt`, `layer_split_vjp.txt`).
SPLIT_VJP = False


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one kernel call (hashable: a `nondiff_argnums` of the custom VJP)."""
  prec: jax.lax.Precision | jax.lax.DotAlgorithmPreset  # of every dot (`kernel_precision` of the caller's)
  ref_prec: jax.lax.Precision  # the caller's precision: the XLA reference's, for the backward
  block_k: int
  block_v: int
  interpret: bool
  num_warps: int
  num_stages: int
  bwd_kernel: bool = False  # BACKWARD_KERNEL at the call
  bwd_block_k: int = 64
  bwd_block_v: int = 64
  bwd_num_warps: int = 4
  bwd_split: bool = False  # BACKWARD_SPLIT at the call
  split_block_k: int = 64
  split_num_warps: int = 8
  lowp_wu: bool = False  # LOWP_WU at the call, for 16-bit inputs
  split: bool = False  # LOCAL_SPLIT at the call
  split_warps: tuple = (8, 8, 8)  # SPLIT_FWD_WARPS at the call
  split_vjp: bool = False  # SPLIT_VJP at the call


def supports(g, beta, masks, beta_kind: str, dtype) -> bool:
  """Whether the fused kernel takes this variant: per-head decay (per-key-channel decay too with
  FUSED_LOCAL_CHANNEL, read now) and per-head beta, no segment masks, 16/32-bit inputs."""
  decay = g is not None and (g.ndim == 2 or (g.ndim == 3 and FUSED_LOCAL_CHANNEL))
  return masks is None and decay and beta_kind == "head" and beta is not None and jnp.dtype(dtype).itemsize <= 4


def _dot(a, b, tb: bool, prec):
  """a @ b (b read transposed with tb), 2-D operands, accumulated in float32."""
  dims = (((1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _dot_ta(a, b, prec):
  """a^T @ b, 2-D operands, accumulated in float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _block_diag(stacked):
  """The block-diagonal [Cp, Cp] whose diagonal SUB x SUB blocks are stacked [Cp, SUB] (row c m + t of it holds
  row t of block m)."""
  Cp = stacked.shape[0]
  M = Cp // SUB
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.int32, (Cp, M, SUB), axis)
  return jnp.where(iota(0) // SUB == iota(1), stacked[:, None, :], 0.0).reshape(Cp, Cp)


def _invert_unit_lower(bA, prec):
  """(I + bA)^{-1} [Cp, Cp] for strictly lower-triangular float32 bA, Cp a power of two >= SUB."""
  Cp = bA.shape[0]
  M = Cp // SUB
  iota = lambda shape, axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis)
  # The diagonal blocks stacked: Ld[m, t, a] = bA[c m + t, c m + a]. Summing over the column blocks of a row
  # adds exact zeros to the one block kept, so the entries are bA's exactly.
  own = iota((Cp, M, SUB), 0) // SUB == iota((Cp, M, SUB), 1)  # [t, m, a]: column block m is row t's block
  Ld = jnp.sum(jnp.where(own, bA.reshape(Cp, M, SUB), 0.0), axis=1).reshape(M, SUB, SUB)
  # Forward substitution in all M blocks at once, on the strictly lower part Ti = T - I: row r of Ti is
  # -L_r - sum_{j < r} L_rj Ti_j (rows at and after r still hold -L, which L_r does not reach).
  r3 = iota((M, SUB, SUB), 1)
  Ti = -Ld
  for r in range(2, SUB):
    a = -jnp.sum(jnp.where(r3 == r, Ld, 0.0), axis=1)  # [M, c]: row r of -L in each block
    new = a + jnp.sum(a[:, :, None] * Ti, axis=1)
    Ti = jnp.where(r3 == r, new[:, None, :], Ti)
  stacked = Ti.reshape(Cp, SUB) + (iota((Cp, SUB), 0) % SUB == iota((Cp, SUB), 1)).astype(jnp.float32)
  T = _block_diag(stacked)
  # Merge pairs of diagonal blocks of size s: the blocks (2p + 1, 2p) of bA are the Y of the docstring.
  row, col = iota((Cp, Cp), 0), iota((Cp, Cp), 1)
  s = SUB
  while s < Cp:
    Y = jnp.where((row // (2 * s) == col // (2 * s)) & (row // s > col // s), bA, 0.0)
    T = T - _dot(T, _dot(Y, T, False, prec), False, prec)
    s *= 2
  return T


def _decays(g, Cp):
  """row, col iotas [Cp, Cp]; e^gamma, e^to_end [Cp, 1]; the decays e^D [Cp, Cp] (zero above the diagonal)."""
  row = jax.lax.broadcasted_iota(jnp.int32, (Cp, Cp), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (Cp, Cp), 1)
  gam = jax.lax.cumsum(g, axis=0)  # sum_{j <= t} g_j
  seg = jax.lax.cumsum(jnp.where(row > col, g[:, None], 0.0), axis=0)  # [t, i]: sum_{i < j <= t} g_j
  to_end = jnp.sum(jnp.where(row == Cp - 1, seg, 0.0), axis=0)  # its last row: sum_{j > i} g_j
  decay = jnp.where(row >= col, jnp.exp(seg), 0.0)
  return row, col, jnp.exp(gam)[:, None], jnp.exp(to_end)[:, None], decay


def _pairs(q_ref, k_ref, g_ref, qdec_ref, kend_ref, p_ref, cfg: Config):
  """Steps 1 and 2: writes q_dec, k_end and P; returns A (strictly lower, float32) and e^gamma [Cp, 1]."""
  Cp, Kp = k_ref.shape
  f32 = jnp.float32
  row, col, e_gam, e_end, decay = _decays(g_ref[...].astype(f32), Cp)
  KK = QK = jnp.zeros((Cp, Cp), f32)
  for j in range(Kp // cfg.block_k):
    ks = pl.ds(j * cfg.block_k, cfg.block_k)
    k, q = k_ref[:, ks], q_ref[:, ks]
    KK = KK + _dot(k, k, True, cfg.prec)
    QK = QK + _dot(q, k, True, cfg.prec)
    qdec_ref[:, ks] = (q.astype(f32) * e_gam).astype(qdec_ref.dtype)
    kend_ref[:, ks] = (k.astype(f32) * e_end).astype(kend_ref.dtype)
  p_ref[...] = jnp.where(row >= col, QK * decay, 0.0).astype(p_ref.dtype)
  return jnp.where(row > col, KK * decay, 0.0), e_gam


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, qdec_ref, kend_ref, p_ref, w_ref, u_ref, *, cfg: Config):
  A, e_gam = _pairs(q_ref, k_ref, g_ref, qdec_ref, kend_ref, p_ref, cfg)
  _write_wu(A, b_ref[...].astype(jnp.float32), lambda ks: e_gam, k_ref, v_ref, w_ref, u_ref, cfg)


def _solve_dtype(cfg: Config, dtype):
  """The dtype of T and the right-hand sides in W's and U's products: the 16-bit inputs' with LOWP_WU (as
  intra_chunk's LOWP_SOLVE), else float32."""
  return dtype if cfg.lowp_wu and jnp.dtype(dtype).itemsize == 2 else jnp.float32


def _write_wu(A, beta, e_gam, k_ref, v_ref, w_ref, u_ref, cfg: Config):
  """Steps 3 and 4: T = (I + Diag(beta) A)^{-1}, then W = T Diag(beta) k_dec and U = T Diag(beta) v over K and
  V blocks; e_gam(ks) is e^gamma for the key channels ks ([Cp, 1] for a per-head decay)."""
  T = _invert_unit_lower(beta[:, None] * A, cfg.prec).astype(_solve_dtype(cfg, k_ref.dtype))
  _apply_t(T, beta, e_gam, k_ref, v_ref, w_ref, u_ref, cfg)


def _apply_t(T, beta, e_gam, k_ref, v_ref, w_ref, u_ref, cfg: Config):
  """Step 4: W = T Diag(beta) k_dec and U = T Diag(beta) v over K and V blocks, the right-hand sides rounded to
  T's dtype."""
  Kp, Vp = k_ref.shape[1], v_ref.shape[1]
  f32 = jnp.float32
  sdt = T.dtype
  for j in range(Kp // cfg.block_k):
    ks = pl.ds(j * cfg.block_k, cfg.block_k)
    rhs = beta[:, None] * (k_ref[:, ks].astype(f32) * e_gam(ks))  # beta k_dec, as intra_chunk forms it
    w_ref[:, ks] = _dot(T, rhs.astype(sdt), False, cfg.prec).astype(w_ref.dtype)
  for j in range(Vp // cfg.block_v):
    vs = pl.ds(j * cfg.block_v, cfg.block_v)
    rhs = beta[:, None] * v_ref[:, vs].astype(f32)
    u_ref[:, vs] = _dot(T, rhs.astype(sdt), False, cfg.prec).astype(u_ref.dtype)


def _pairs_kernel(q_ref, k_ref, g_ref, b_ref, qdec_ref, kend_ref, p_ref, ba_ref, *, cfg: Config):
  """LOCAL_SPLIT's first kernel: steps 1 and 2 (`_kernel`'s), with Diag(beta) A [Cp, Cp] in float32 to memory."""
  A, _ = _pairs(q_ref, k_ref, g_ref, qdec_ref, kend_ref, p_ref, cfg)
  ba_ref[...] = b_ref[...].astype(jnp.float32)[:, None] * A


def _invert_sub(L):
  """(I + L)^{-1} [SUB, SUB] for a strictly lower-triangular float32 L, by forward substitution: row r of
  Ti = T - I is -L_r - sum_{j < r} L_rj Ti_j (`_invert_unit_lower`'s, on one block)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  Ti = -L
  for r in range(2, SUB):
    a = -jnp.sum(jnp.where(rows == r, L, 0.0), axis=0)  # row r of -L
    Ti = jnp.where(rows == r, (a + jnp.sum(a[:, None] * Ti, axis=0))[None, :], Ti)
  return Ti + (rows == jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)).astype(jnp.float32)


def _solve_kernel(ba_ref, t_ref, *, cfg: Config):
  """LOCAL_SPLIT's second kernel: step 3, T = (I + Diag(beta) A)^{-1} in t_ref's dtype, block by block of SUB x
  SUB (fla's solve_tril): each diagonal block T_ii = (I + L_ii)^{-1} by forward substitution, then block forward
  substitution for the blocks below, T_ij = -T_ii sum_{j <= k < i} L_ik T_kj, as [SUB, SUB] dots loaded and
  stored as static slices of the refs; at most M (M + 1) / 2 of them float32 in registers, where
  `_invert_unit_lower`'s merges keep several [Cp, Cp] matrices live."""
  M = ba_ref.shape[0] // SUB
  blk = lambda i: pl.ds(i * SUB, SUB)
  L = lambda i, j: ba_ref[blk(i), blk(j)].astype(jnp.float32)
  T = {}
  for i in range(M):
    T[i, i] = _invert_sub(L(i, i))
    for j in range(i - 1, -1, -1):
      acc = sum(_dot(L(i, k), T[k, j], False, cfg.prec) for k in range(j, i))
      T[i, j] = -_dot(T[i, i], acc, False, cfg.prec)
  for i in range(M):
    for j in range(M):
      t_ref[blk(i), blk(j)] = (T[i, j] if j <= i else jnp.zeros((SUB, SUB), jnp.float32)).astype(t_ref.dtype)


def _solve_call(cfg: Config, bA, dtype, num_warps: int):
  """T [n, Cp, Cp] in `dtype` from Diag(beta) A [n, Cp, Cp] float32: `_solve_kernel`, one program a chunk."""
  n, Cp = bA.shape[0], bA.shape[-1]
  rows = pl.BlockSpec((None, Cp, Cp), lambda i: (i, 0, 0))
  return pl.pallas_call(
      functools.partial(_solve_kernel, cfg=cfg), grid=(n,), in_specs=[rows], out_specs=rows,
      out_shape=jax.ShapeDtypeStruct((n, Cp, Cp), dtype), interpret=cfg.interpret, name="gdn_chunk_local_solve",
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages))(bA)


def solve_supports(L) -> bool:
  """Whether `solve` takes L: float32 [.., C, C], C a power of two of at least SUB."""
  C = L.shape[-1]
  return L.dtype == jnp.float32 and L.ndim >= 2 and L.shape[-2] == C and C >= SUB and C & (C - 1) == 0


def solve(L, prec, dtype, interpret: Optional[bool] = None):
  """(I + L)^{-1} [.., C, C] in `dtype` for a strictly lower-triangular float32 L (`solve_supports`): LOCAL_SPLIT's
  solve kernel (16 x 16 blocks), one program per matrix, with SPLIT_FWD_WARPS' second entry;
  `intra_chunk.SOLVE_KERNEL` routes `intra_chunk.invert_unit_lower`'s value here. interpret: Pallas' interpreter,
  None: where the default backend is not a GPU."""
  interpret = default_interpret() if interpret is None else interpret
  cfg = make_config(prec, interpret)
  C = L.shape[-1]
  static = (cfg, jnp.dtype(dtype), cfg.split_warps[1])
  return batched_rows(_SOLVE, static, L.reshape((-1, C, C))).reshape(L.shape)


def _solve_rows(static, bA):
  return _solve_call(static[0], bA, *static[1:])


_SOLVE = per_rows(_solve_rows)  # each device solves its own matrices (pallas_common)


def _apply_kernel(t_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, *, cfg: Config):
  """LOCAL_SPLIT's third kernel: step 4 from T, e^gamma recomputed from g (one cumulative sum)."""
  f32 = jnp.float32
  e_gam = jnp.exp(jax.lax.cumsum(g_ref[...].astype(f32), axis=0))[:, None]
  _apply_t(t_ref[...], b_ref[...].astype(f32), lambda ks: e_gam, k_ref, v_ref, w_ref, u_ref, cfg)


def _split_forward(cfg: Config, ins, L, Cp, Kp, Vp, odt):
  """(q_dec, k_end, P, W, U, T), padded, from LOCAL_SPLIT's three kernels; ins as `_forward` pads them."""
  q, k, v, g, beta = ins
  rows = lambda *s: pl.BlockSpec((None,) + s, lambda i: (i,) + (0,) * len(s))
  call = lambda kernel, ins_, outs, name, warps: pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=(L,), in_specs=[rows(*x.shape[1:]) for x in ins_],
      out_specs=[rows(*o.shape[1:]) for o in outs], out_shape=outs, interpret=cfg.interpret, name=name,
      compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=cfg.num_stages))(*ins_)
  out = lambda dtype, *s: jax.ShapeDtypeStruct((L,) + s, dtype)
  pairs_warps, solve_warps, apply_warps = cfg.split_warps
  q_dec, k_end, P, bA = call(_pairs_kernel, [q, k, g, beta],
                             [out(odt, Cp, Kp), out(odt, Cp, Kp), out(odt, Cp, Cp), out(jnp.float32, Cp, Cp)],
                             "gdn_chunk_local_pairs", pairs_warps)
  T = _solve_call(cfg, bA, _solve_dtype(cfg, odt), solve_warps)
  W, U = call(_apply_kernel, [T, k, v, g, beta], [out(odt, Cp, Kp), out(odt, Cp, Vp)], "gdn_chunk_local_apply",
              apply_warps)
  return q_dec, k_end, P, W, U, T


def _level_masks(Cp: int, s: int):
  """The dyadic level of half blocks of s steps (`intra_chunk._pair_channel_dyadic`), as [Cp, Cp] masks: span
  [t, j], the steps j whose log-decays t's factor sums (over (a, t] for t in an upper half, whose boundary a is
  that half's first step; over (t, a] for t in a lower half, a the first step of the upper half after it); pair
  [t, i], the pairs anchored at this level (t in an upper half, i in the lower half of the same block)."""
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.int32, (Cp, Cp), axis)
  t, j = iota(0), iota(1)
  upper_t, upper_j = (t // s) % 2 == 1, (j // s) % 2 == 1
  a = (t // (2 * s)) * (2 * s) + s
  span = jnp.where(upper_t, (j > a) & (j <= t), (j > t) & (j <= a))
  pair = (t // (2 * s) == j // (2 * s)) & upper_t & ~upper_j
  return span, pair


def _channel_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, qdec_ref, kend_ref, p_ref, w_ref, u_ref, *, cfg: Config):
  """`_kernel` for a per-key-channel decay g [Cp, Kp] (KDA), by `intra_chunk._pair_channel_dyadic`'s dyadic
  anchors, every level as dense [Cp, Cp] work (no [Cp, Cp, Kp] tensor, no sub-chunk loop), per block of BK keys:

    for each level s = 1, 2, .., Cp/2: the exponents E = span_s @ g (a 0/1 mask times the log-decays, an exact
      float32 dot: each entry a sum over one span inside a half block, <= 0, so no e^{+x} and no cancellation,
      whatever the decays), the factors k e^E and q e^E, and A += pair_s * (k e^E)(k e^E)^T, P likewise with
      q e^E on the left: every pair t > i is anchored at exactly one level, where its decay factors as
      e^{E_t} e^{E_i}.

  The diagonal of P is q_t . k_t (decay 1). gamma is a cumulative sum, the sums to the chunk's end one more exact
  dot with the mask [j > t]. The factors' dots take the inputs' dtype as operands (bfloat16 for bfloat16
  callers, as the per-head kernel's k k^T and q k^T read the inputs), accumulated in float32."""
  Cp, Kp = k_ref.shape
  BK = cfg.block_k
  f32 = jnp.float32
  exact = jax.lax.Precision.HIGHEST  # the span sums: IEEE float32 products of 0/1 and g
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.int32, (Cp, Cp), axis)
  row, col = iota(0), iota(1)
  to_end_mask = (col > row).astype(f32)
  odt = k_ref.dtype
  load = lambda ks: tuple(x[:, ks].astype(f32) for x in (q_ref, k_ref, g_ref))
  qk = jnp.zeros((Cp,), f32)
  for n in range(Kp // BK):
    ks = pl.ds(n * BK, BK)
    q, k, g = load(ks)
    qdec_ref[:, ks] = (q * jnp.exp(jax.lax.cumsum(g, axis=0))).astype(qdec_ref.dtype)
    kend_ref[:, ks] = (k * jnp.exp(_dot(to_end_mask, g, False, exact))).astype(kend_ref.dtype)
    qk = qk + jnp.sum(q * k, axis=1)
  # Levels outside, key blocks inside: one level's masks live at a time. The key blocks are a loop, not unrolled:
  # unrolled, Triton keeps every block's loads live across the levels (13,252 bytes of spill stores offline).
  A = P = jnp.zeros((Cp, Cp), f32)
  s = 1
  while s < Cp:
    span, pair = _level_masks(Cp, s)
    span = span.astype(f32)
    def step(n, AP, span=span, pair=pair):
      q, k, g = load(pl.ds(pl.multiple_of(n * BK, BK), BK))
      e = jnp.exp(_dot(span, g, False, exact))
      kf, qf = (k * e).astype(odt), (q * e).astype(odt)
      return (AP[0] + jnp.where(pair, _dot(kf, kf, True, cfg.prec), 0.0),
              AP[1] + jnp.where(pair, _dot(qf, kf, True, cfg.prec), 0.0))
    A, P = jax.lax.fori_loop(0, Kp // BK, step, (A, P))
    s *= 2
  p_ref[...] = jnp.where(row == col, qk[:, None], P).astype(p_ref.dtype)
  _write_wu(A, b_ref[...].astype(f32), lambda ks: jnp.exp(jax.lax.cumsum(g_ref[:, ks].astype(f32), axis=0)),
            k_ref, v_ref, w_ref, u_ref, cfg)


def _solve_and_dT(k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, cfg: Config, t_ref=None):
  """The backward's recomputation and first cotangent, one chunk: (`_decays`' five), beta [Cp, 1], A, T and
  dT = dW X_w^T + dU X_u^T, over blocks of cfg.bwd_block_k keys and cfg.bwd_block_v values; T also written to
  t_ref where given, before dT (offline: 247 registers and no spill in `_bwd_solve_kernel`, 255 and 24 bytes of
  spills at blocks of 16 when written after)."""
  Cp, Kp = k_ref.shape
  Vp = v_ref.shape[-1]
  BK, BV, prec = cfg.bwd_block_k, cfg.bwd_block_v, cfg.prec
  f32 = jnp.float32
  bcol = b_ref[...].astype(f32)[:, None]
  decays = row, col, e_gam, _, decay = _decays(g_ref[...].astype(f32), Cp)
  KK = jnp.zeros((Cp, Cp), f32)
  for j in range(Kp // BK):
    k = k_ref[:, pl.ds(j * BK, BK)]
    KK = KK + _dot(k, k, True, prec)
  A = jnp.where(row > col, KK * decay, 0.0)
  T = _invert_unit_lower(bcol * A, prec)
  if t_ref is not None:
    t_ref[...] = T
  dT = jnp.zeros((Cp, Cp), f32)
  for j in range(Kp // BK):
    ks = pl.ds(j * BK, BK)
    dT = dT + _dot(dw_ref[:, ks].astype(f32), bcol * (k_ref[:, ks].astype(f32) * e_gam), True, prec)
  for j in range(Vp // BV):
    vs = pl.ds(j * BV, BV)
    dT = dT + _dot(du_ref[:, vs].astype(f32), bcol * v_ref[:, vs].astype(f32), True, prec)
  return decays, bcol, A, T, dT


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, dqd_ref, dke_ref, dp_ref, dw_ref, du_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, *, cfg: Config):
  """The VJP of `_kernel`'s five outputs for one chunk, recomputing the decays, A and T (fla's
  prepare_wy_repr_bwd and chunk_bwd_dqkwg in one program). With X_w = Diag(beta) k e^gamma, X_u = Diag(beta) v,
  W = T X_w, U = T X_u and M = I + Diag(beta) A, T = M^{-1}:
    dT = dW X_w^T + dU X_u^T, dM = -T^T dT T^T, dA = strictly-lower(Diag(beta) dM), dX = T^T [dW, dU];
    dKK = dA e^D, dQK = lower(dP) e^D (what reaches k k^T and q k^T); dD = dKK KK + dQK QK (what reaches D);
    dq = dq_dec e^gamma + dQK k, dk = dX_w beta e^gamma + dk_end e^to_end + dQK^T q + (dKK + dKK^T) k,
    dv = beta dX_u, dbeta = rowsum(dM A) + rowsum(dX_w k e^gamma) + rowsum(dX_u v);
  dg_j sums the decay terms over the spans that hold j: gamma_t (t >= j), to_end_i (i < j), D_ti (i < j <= t).
  k k^T and q k^T take the inputs' dtype, as in the forward; the other dots float32 operands; the elementwise
  work is float32."""
  Cp, Kp = k_ref.shape
  Vp = v_ref.shape[-1]
  BK, BV, prec = cfg.bwd_block_k, cfg.bwd_block_v, cfg.prec
  f32 = jnp.float32
  # Phases ordered so that few [Cp, Cp] float32 matrices are live at once (each is 32 registers a thread at
  # Cp = 64 and 4 warps): A and T; then dT; then dKK, the decay-gradient dD and QK; then T, dQK, dKK + dKK^T.
  (row, col, e_gam, e_end, decay), bcol, A, T, dT = _solve_and_dT(k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, cfg)
  dM = -_dot(_dot_ta(T, dT, prec), T, True, prec)  # -T^T dT T^T
  dbeta = jnp.sum(dM * A, axis=1)
  dA = jnp.where(row > col, bcol * dM, 0.0)
  dD = dA * A  # zero above the diagonal, as every term of dD
  dKK = dA * decay
  QK = jnp.zeros((Cp, Cp), f32)
  for j in range(Kp // BK):
    ks = pl.ds(j * BK, BK)
    QK = QK + _dot(q_ref[:, ks], k_ref[:, ks], True, prec)
  dQK = jnp.where(row >= col, dp_ref[...].astype(f32), 0.0) * decay
  dg = _span_share(dD + dQK * QK, row, col)
  dKs = dKK + dKK.T  # symmetric
  # dq first, then T and dQK transposed once (the originals die): the dk loop reads only T^T, dQK^T and dKs.
  dgam = dto_end = jnp.zeros((Cp,), f32)
  for j in range(Kp // BK):
    ks = pl.ds(j * BK, BK)
    q_dec = q_ref[:, ks].astype(f32) * e_gam
    dqd = dqd_ref[:, ks].astype(f32)
    dgam = dgam + jnp.sum(dqd * q_dec, axis=1)
    dq_ref[:, ks] = (dqd * e_gam + _dot(dQK, k_ref[:, ks].astype(f32), False, prec)).astype(dq_ref.dtype)
  Tt, dQKt = T.T, dQK.T
  for j in range(Vp // BV):
    vs = pl.ds(j * BV, BV)
    dXu = _dot(Tt, du_ref[:, vs].astype(f32), False, prec)
    dbeta = dbeta + jnp.sum(dXu * v_ref[:, vs].astype(f32), axis=1)
    dv_ref[:, vs] = (bcol * dXu).astype(dv_ref.dtype)
  for j in range(Kp // BK):
    ks = pl.ds(j * BK, BK)
    k = k_ref[:, ks].astype(f32)
    dke = dke_ref[:, ks].astype(f32)
    dXw = _dot(Tt, dw_ref[:, ks].astype(f32), False, prec)
    k_dec = k * e_gam
    dgam = dgam + jnp.sum(dXw * k_dec * bcol, axis=1)
    dbeta = dbeta + jnp.sum(dXw * k_dec, axis=1)
    dto_end = dto_end + jnp.sum(dke * k * e_end, axis=1)
    dk = (dXw * bcol * e_gam + dke * e_end + _dot(dQKt, q_ref[:, ks].astype(f32), False, prec)
          + _dot(dKs, k, False, prec))
    dk_ref[:, ks] = dk.astype(dk_ref.dtype)
  # dg_j's shares of gamma_t (t >= j) and to_end_i (i < j)
  dg = dg + jnp.sum(jnp.where(row >= col, dgam[:, None], 0.0) + jnp.where(row < col, dto_end[:, None], 0.0), axis=0)
  dg_ref[...] = dg.astype(dg_ref.dtype)
  db_ref[...] = dbeta.astype(db_ref.dtype)


def _bwd_solve_kernel(k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, t_ref, dm_ref, dv_ref, db_ref, *, cfg: Config):
  """The split backward's first kernel, one chunk: `_bwd_kernel`'s solve. Recomputes the decays, A and T; writes T
  and strictly-lower(dM) (float32 [Cp, Cp], what `_bwd_dqk_kernel` turns into dk, dq and the rest of dg and
  dbeta), dv = beta T^T dU, and dbeta's share rowsum(dX_u v). The decays and A die at T, dT at dM, which is
  written before the dv loop (with dX_u computed while dT was summed: 168 bytes of spills offline, not none)."""
  Cp, Vp = v_ref.shape
  BV, prec, f32 = cfg.bwd_block_v, cfg.prec, jnp.float32
  (row, col, _, _, _), bcol, _, T, dT = _solve_and_dT(k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, cfg, t_ref)
  dbeta = jnp.zeros((Cp,), f32)
  dm_ref[...] = jnp.where(row > col, -_dot(_dot_ta(T, dT, prec), T, True, prec), 0.0)  # dM = -T^T dT T^T
  for j in range(Vp // BV):
    vs = pl.ds(j * BV, BV)
    v, du = v_ref[:, vs].astype(f32), du_ref[:, vs].astype(f32)
    dXu = _dot_ta(T, du, prec)
    dbeta = dbeta + jnp.sum(dXu * v, axis=1)
    dv_ref[:, vs] = (bcol * dXu).astype(dv_ref.dtype)
  db_ref[...] = dbeta


def _span_share(dD, row, col):
  """dg_j's share of D from its cotangent dD [Cp, Cp] (zero above the diagonal): sum_{t >= j} sum_{i < j} dD_ti;
  the inner sum is the inclusive row cumulative sum less its own term (a reverse cumulative sum does not lower to
  Triton)."""
  return jnp.sum(jnp.where(row >= col, jax.lax.cumsum(dD, axis=1) - dD, 0.0), axis=0)


def _bwd_dqk_kernel(q_ref, k_ref, g_ref, b_ref, dqd_ref, dke_ref, dp_ref, dw_ref, t_ref, dm_ref,
                    dq_ref, dk_ref, dg_ref, db_ref, *, cfg: Config):
  """The split backward's second kernel, one chunk and one block of keys: with the decays recomputed, dKK =
  Diag(beta) dM e^D (dA e^D) and dQK = lower(dP) e^D, dq = dq_dec e^gamma + dQK k, dX_w = T^T dW and dk = dX_w beta
  e^gamma + dk_end e^to_end + dQK^T q + (dKK + dKK^T) k (float32 operands, as in `_bwd_kernel`), and this block's
  shares of dg and dbeta, which the caller sums over the blocks: A and P are linear in k k^T and q k^T, so with
  this block's KK_b = k k^T and QK_b = q k^T, dbeta's rowsum(dM A) is the sum over blocks of rowsum(dM e^D KK_b),
  and D's cotangent dA A + dQK QK that of dKK KK_b + dQK QK_b; dg takes the spans of D, gamma and to_end, dbeta
  also rowsum(dX_w k_dec)."""
  Cp = k_ref.shape[0]
  prec = cfg.prec
  f32 = jnp.float32
  g = g_ref[...].astype(f32)
  bcol = b_ref[...].astype(f32)[:, None]
  row, col, e_gam, e_end, decay = _decays(g, Cp)
  q, k = q_ref[...].astype(f32), k_ref[...].astype(f32)
  dqd, dke = dqd_ref[...].astype(f32), dke_ref[...].astype(f32)
  dQK = jnp.where(row >= col, dp_ref[...].astype(f32), 0.0) * decay
  dMe = dm_ref[...] * decay  # zero on and above the diagonal
  KK = _dot(k_ref[...], k_ref[...], True, prec)
  dbeta = jnp.sum(dMe * KK, axis=1)
  dKK = bcol * dMe
  dg = _span_share(dKK * KK + dQK * _dot(q_ref[...], k_ref[...], True, prec), row, col)
  dq_ref[...] = (dqd * e_gam + _dot(dQK, k, False, prec)).astype(dq_ref.dtype)
  dXw = _dot_ta(t_ref[...], dw_ref[...].astype(f32), prec)
  k_dec = k * e_gam
  dgam = jnp.sum(dqd * q * e_gam, axis=1) + jnp.sum(dXw * k_dec * bcol, axis=1)
  dto_end = jnp.sum(dke * k * e_end, axis=1)
  dk = dXw * bcol * e_gam + dke * e_end + _dot_ta(dQK, q, prec) + _dot(dKK + dKK.T, k, False, prec)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  # dg_j's shares of gamma_t (t >= j) and to_end_i (i < j)
  dg_ref[...] = dg + jnp.sum(jnp.where(row >= col, dgam[:, None], 0.0) + jnp.where(row < col, dto_end[:, None], 0.0),
                             axis=0)
  db_ref[...] = dbeta + jnp.sum(dXw * k_dec, axis=1)


def _pad(x, *target):
  """Zero-pad the trailing axes of x to `target`: zero keys, values and betas, and log-decays 0 after the
  chunk's end, change nothing in the rows that are kept (every quantity is causal inside the chunk)."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - len(target)) + [(0, t - s) for s, t in zip(x.shape[-len(target):], target)])


def _forward(cfg: Config, q, k, v, g, beta, with_t: bool = False):
  """(q_dec, k_end, P, W, U) [L, C, ...] in k's dtype, from q (scaled), k [L, C, K], v [L, C, V], g [L, C] (per
  head: `_kernel`, or LOCAL_SPLIT's three) or [L, C, K] (per key channel: `_channel_kernel`), beta [L, C]; with
  `with_t` (LOCAL_SPLIT's kernels only), and T [L, C, C]. Under a multi-device jit each device runs the kernels on
  its own chunks (`pallas_common.per_rows`)."""
  return batched_rows(_FORWARD, (cfg, with_t), q, k, v, g, beta)


def _forward_rows(static, q, k, v, g, beta):
  cfg, with_t = static
  L, C, K = k.shape
  V = v.shape[-1]
  Cp, Kp, Vp = pow2(C), pow2(K), pow2(V)
  BK, BV = min(cfg.block_k, Kp), min(cfg.block_v, Vp)
  odt = k.dtype
  gs = (Cp, Kp)[:g.ndim - 1]  # g's padded block: [Cp] per head, [Cp, Kp] per key channel
  ins = [_pad(q, Cp, Kp), _pad(k, Cp, Kp), _pad(v, Cp, Vp), _pad(g, *gs), _pad(beta, Cp)]
  rows = lambda *s: pl.BlockSpec((None,) + s, lambda i: (i,) + (0,) * len(s))
  out = lambda *s: jax.ShapeDtypeStruct((L,) + s, odt)
  cfg = dataclasses.replace(cfg, block_k=BK, block_v=BV)
  if cfg.split and g.ndim == 2:
    q_dec, k_end, P, W, U, T = _split_forward(cfg, ins, L, Cp, Kp, Vp, odt)
    out = q_dec[:, :C, :K], k_end[:, :C, :K], P[:, :C, :C], W[:, :C, :K], U[:, :C, :V]
    return (out, T[:, :C, :C]) if with_t else out
  kernel = functools.partial(_channel_kernel if g.ndim == 3 else _kernel, cfg=cfg)
  res = pl.pallas_call(
      kernel, grid=(L,),
      in_specs=[rows(Cp, Kp), rows(Cp, Kp), rows(Cp, Vp), rows(*gs), rows(Cp)],
      out_specs=[rows(Cp, Kp), rows(Cp, Kp), rows(Cp, Cp), rows(Cp, Kp), rows(Cp, Vp)],
      out_shape=[out(Cp, Kp), out(Cp, Kp), out(Cp, Cp), out(Cp, Kp), out(Cp, Vp)],
      interpret=cfg.interpret, name="gdn_chunk_local_channel" if g.ndim == 3 else "gdn_chunk_local",
      compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))(*ins)
  q_dec, k_end, P, W, U = res
  return q_dec[:, :C, :K], k_end[:, :C, :K], P[:, :C, :C], W[:, :C, :K], U[:, :C, :V]


_FORWARD = per_rows(_forward_rows)


def backward_kernel(cfg: Config, q, k, v, g, beta, cts):
  """(dq, dk, dv, dg, dbeta) in the inputs' dtypes from the backward kernel (the two of `_split_backward` with
  cfg.bwd_split); cts the cotangents of `_forward`'s (q_dec, k_end, P, W, U), in k's dtype. Public for benchmarks
  and tests, which time and check it against the VJP of `reference`. Per device, as `_forward`."""
  return batched_rows(_BACKWARD, cfg, q, k, v, g, beta, tuple(cts))


def _backward_rows(cfg: Config, q, k, v, g, beta, cts):
  L, C, K = k.shape
  V = v.shape[-1]
  Cp, Kp, Vp = pow2(C), pow2(K), pow2(V)
  BK, BV = min(cfg.bwd_block_k, Kp), min(cfg.bwd_block_v, Vp)
  dqd, dke, dP, dW, dU = cts
  ins = [_pad(q, Cp, Kp), _pad(k, Cp, Kp), _pad(v, Cp, Vp), _pad(g, Cp), _pad(beta, Cp),
         _pad(dqd, Cp, Kp), _pad(dke, Cp, Kp), _pad(dP, Cp, Cp), _pad(dW, Cp, Kp), _pad(dU, Cp, Vp)]
  if cfg.bwd_split:
    dq, dk, dv, dg, db = _split_backward(cfg, ins, L, Cp, Kp, Vp)
    return dq[:, :C, :K], dk[:, :C, :K], dv[:, :C, :V], dg[:, :C], db[:, :C]
  rows = lambda *s: pl.BlockSpec((None,) + s, lambda i: (i,) + (0,) * len(s))
  kernel = functools.partial(_bwd_kernel, cfg=dataclasses.replace(cfg, bwd_block_k=BK, bwd_block_v=BV))
  dq, dk, dv, dg, db = pl.pallas_call(
      kernel, grid=(L,),
      in_specs=[rows(Cp, Kp), rows(Cp, Kp), rows(Cp, Vp), rows(Cp), rows(Cp),
                rows(Cp, Kp), rows(Cp, Kp), rows(Cp, Cp), rows(Cp, Kp), rows(Cp, Vp)],
      out_specs=[rows(Cp, Kp), rows(Cp, Kp), rows(Cp, Vp), rows(Cp), rows(Cp)],
      out_shape=[jax.ShapeDtypeStruct((L, Cp, Kp), q.dtype), jax.ShapeDtypeStruct((L, Cp, Kp), k.dtype),
                 jax.ShapeDtypeStruct((L, Cp, Vp), v.dtype), jax.ShapeDtypeStruct((L, Cp), g.dtype),
                 jax.ShapeDtypeStruct((L, Cp), beta.dtype)],
      interpret=cfg.interpret, name="gdn_chunk_local_bwd",
      compiler_params=pl_triton.CompilerParams(num_warps=cfg.bwd_num_warps, num_stages=cfg.num_stages))(*ins)
  return dq[:, :C, :K], dk[:, :C, :K], dv[:, :C, :V], dg[:, :C], db[:, :C]


_BACKWARD = per_rows(_backward_rows)


def _split_backward(cfg: Config, ins, L, Cp, Kp, Vp):
  """(dq, dk, dv, dg, dbeta) padded, from `_bwd_solve_kernel` then `_bwd_dqk_kernel` on `backward_kernel`'s padded
  inputs; the second kernel's per-block shares of dg and dbeta summed here."""
  q, k, v, g, beta, dqd, dke, dP, dW, dU = ins
  BK, BV, SK = min(cfg.bwd_block_k, Kp), min(cfg.bwd_block_v, Vp), min(cfg.split_block_k, Kp)
  f32 = jnp.float32
  rows = lambda *s: pl.BlockSpec((None,) + s, lambda i: (i,) + (0,) * len(s))
  square = jax.ShapeDtypeStruct((L, Cp, Cp), f32)
  T, dM, dv, db = pl.pallas_call(
      functools.partial(_bwd_solve_kernel, cfg=dataclasses.replace(cfg, bwd_block_k=BK, bwd_block_v=BV)),
      grid=(L,),
      in_specs=[rows(Cp, Kp), rows(Cp, Vp), rows(Cp), rows(Cp), rows(Cp, Kp), rows(Cp, Vp)],
      out_specs=[rows(Cp, Cp), rows(Cp, Cp), rows(Cp, Vp), rows(Cp)],
      out_shape=[square, square, jax.ShapeDtypeStruct((L, Cp, Vp), v.dtype), jax.ShapeDtypeStruct((L, Cp), f32)],
      interpret=cfg.interpret, name="gdn_chunk_local_bwd_solve",
      compiler_params=pl_triton.CompilerParams(num_warps=cfg.bwd_num_warps, num_stages=cfg.num_stages),
  )(k, v, g, beta, dW, dU)
  nk = Kp // SK
  keys = pl.BlockSpec((None, Cp, SK), lambda i, j: (i, 0, j))
  whole = lambda *s: pl.BlockSpec((None,) + s, lambda i, j: (i,) + (0,) * len(s))
  share = pl.BlockSpec((None, None, Cp), lambda i, j: (i, j, 0))
  dq, dk, dg_k, db_k = pl.pallas_call(
      functools.partial(_bwd_dqk_kernel, cfg=cfg), grid=(L, nk),
      in_specs=[keys, keys, whole(Cp), whole(Cp), keys, keys, whole(Cp, Cp), keys, whole(Cp, Cp), whole(Cp, Cp)],
      out_specs=[keys, keys, share, share],
      out_shape=[jax.ShapeDtypeStruct((L, Cp, Kp), q.dtype), jax.ShapeDtypeStruct((L, Cp, Kp), k.dtype),
                 jax.ShapeDtypeStruct((L, nk, Cp), f32), jax.ShapeDtypeStruct((L, nk, Cp), f32)],
      interpret=cfg.interpret, name="gdn_chunk_local_bwd_dqk",
      compiler_params=pl_triton.CompilerParams(num_warps=cfg.split_num_warps, num_stages=cfg.num_stages),
  )(q, k, g, beta, dqd, dke, dP, dW, T, dM)
  return dq, dk, dv, dg_k.sum(axis=1).astype(g.dtype), (db + db_k.sum(axis=1)).astype(beta.dtype)


def reference(prec, q, k, v, g, beta):
  """The kernel's five arrays (q_dec, k_end, P, W, U) from the XLA stage, `intra_chunk.local`: what the kernels
  are checked and timed against."""
  loc = intra_chunk.local(q, k, v, g, beta, None, beta_kind="head", prec=prec)
  return loc.q_dec, loc.k_end, loc.P, loc.W, loc.U


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: Config, q, k, v, g, beta):
  return _forward(cfg, q, k, v, g, beta)


def _takes_split_vjp(cfg: Config, g) -> bool:
  return cfg.split and cfg.split_vjp and not cfg.bwd_kernel and g.ndim == 2


def _fused_fwd(cfg, q, k, v, g, beta):
  if cfg.bwd_kernel:
    return _forward(cfg, q, k, v, g, beta), (q, k, v, g, beta)
  if _takes_split_vjp(cfg, g):
    out, T = _forward(cfg, q, k, v, g, beta, with_t=True)
    return out, (q, k, v, g, beta, T)
  out, vjp = jax.vjp(functools.partial(reference, cfg.ref_prec), q, k, v, g, beta)
  return out, (vjp, k)


def _fused_bwd(cfg, res, cts):
  k = res[1]
  cts = tuple(ct.astype(k.dtype) for ct in cts)  # every output's dtype: a cotangent may come back wider
  if cfg.bwd_kernel:
    return backward_kernel(cfg, *res, cts)
  if len(res) == 6:  # SPLIT_VJP's forward saved the inputs and T
    q, k, v, g, beta, T = res
    dq_dec, dk_end, dP, dW, dU = cts
    L = g.shape[0]
    ct = intra_chunk.Local(q_dec=dq_dec, k_dec=jnp.zeros_like(dq_dec), k_end=dk_end, decay=jnp.zeros((L, 1), g.dtype),
                           P=dP, A=jnp.zeros_like(dP), W=dW, U=dU)
    return intra_chunk.local_vjp(cfg.ref_prec, q, k, v, g, beta, T, ct)
  vjp, _ = res
  return vjp(cts)


_fused.defvjp(_fused_fwd, _fused_bwd)


def make_config(prec, interpret: bool, *, block_k: Optional[int] = None, block_v: Optional[int] = None,
                bwd_kernel: Optional[bool] = None, bwd_split: Optional[bool] = None, channel: bool = False,
                num_warps: Optional[int] = None) -> Config:
  """A call's settings from the module's (read now): the caller's precision, the forward's blocks (None:
  BLOCK_K, or CHANNEL_BLOCK_K for a per-key-channel decay, and BLOCK_V) and warps (NUM_WARPS, CHANNEL_NUM_WARPS
  for a per-key-channel decay; `num_warps` where given), BACKWARD_KERNEL unless `bwd_kernel` is
  given (never for a per-key-channel decay: the backward kernel takes a per-head one), BACKWARD_SPLIT unless
  `bwd_split` is given, and the backward kernels' blocks and warps."""
  bwd_kernel = bool(BACKWARD_KERNEL if bwd_kernel is None else bwd_kernel) and not channel
  return Config(prec=kernel_precision(prec, interpret), ref_prec=prec,
                block_k=pow2(block_k or (CHANNEL_BLOCK_K if channel else BLOCK_K)), block_v=pow2(block_v or BLOCK_V),
                interpret=interpret, num_warps=num_warps or (CHANNEL_NUM_WARPS if channel else NUM_WARPS),
                num_stages=NUM_STAGES,
                bwd_kernel=bwd_kernel,
                bwd_block_k=pow2(BWD_BLOCK_K), bwd_block_v=pow2(BWD_BLOCK_V), bwd_num_warps=BWD_NUM_WARPS,
                bwd_split=bool(BACKWARD_SPLIT if bwd_split is None else bwd_split),
                split_block_k=pow2(SPLIT_BLOCK_K), split_num_warps=SPLIT_NUM_WARPS, lowp_wu=bool(LOWP_WU),
                split=bool(LOCAL_SPLIT), split_warps=tuple(int(w) for w in SPLIT_FWD_WARPS),
                split_vjp=bool(SPLIT_VJP))


def local(q, k, v, g, beta, masks, *, beta_kind: str, prec, solver: str = "blocked", block_k: Optional[int] = None,
          block_v: Optional[int] = None, interpret: Optional[bool] = None,
          num_warps: Optional[int] = None) -> intra_chunk.Local:
  """`intra_chunk.local`'s signature and results (k_dec and A None) through the fused kernel where `supports`
  says so, else `intra_chunk.local` itself (segment masks, per-key-channel decay while FUSED_LOCAL_CHANNEL is
  off, no decay, no or per-channel beta, float64). q (already scaled), k [L, C, K]; v [L, C, V]; g [L, C] or
  [L, C, K]; beta [L, C]. `solver` reaches only the fallback; block_k, block_v: None for BLOCK_K (CHANNEL_BLOCK_K
  for a per-key-channel decay), BLOCK_V (read at the call, as NUM_WARPS and NUM_STAGES are); interpret: Pallas'
  interpreter, None: where the default backend is not a GPU; num_warps: None for the module's."""
  if not supports(g, beta, masks, beta_kind, jnp.result_type(q, k, v)):
    return intra_chunk.local(q, k, v, g, beta, masks, beta_kind=beta_kind, prec=prec, solver=solver)
  interpret = default_interpret() if interpret is None else interpret
  cfg = make_config(prec, interpret, block_k=block_k, block_v=block_v, channel=g.ndim == 3, num_warps=num_warps)
  q_dec, k_end, P, W, U = _fused(cfg, q, k, v, g, beta)
  # as intra_chunk: the last inclusive cumulative log-decay, [L, 1] per head, [L, K] per key channel
  decay = jnp.exp(jnp.cumsum(g, axis=1)[:, -1].reshape(g.shape[0], -1))
  return intra_chunk.Local(q_dec=q_dec, k_dec=None, k_end=k_end, decay=decay, P=P, A=None, W=W, U=U)
