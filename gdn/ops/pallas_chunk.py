"""Chunkwise gated delta rule with the chunk-to-chunk recurrence as one Pallas kernel (forward and backward).

Shapes: B batch, T time, HV value heads, L = B * HV, N chunks, C chunk size, K key dim, V value dim,
BV value channels per kernel program; Cp, Kp, Vp the padded C, K, V.

The chunk-local work (`chunk.prepare`) and the output (`chunk.finish`) stay in XLA: they are batched matmuls.
The sequential part, for n = 0 .. N-1 from S = S0,

    S_in[n] = S;   U[n] = U0[n] - W[n] S;   S = Diag(decay[n]) S + k_end[n]^T U[n]

runs as one kernel whose grid is (L, Vp / BV): each program owns the state block S [Kp, BV] in float32 and
loops over the chunks in order (value channels never mix in the recurrence, so V splits into independent
programs). The backward kernel runs the chunks in reverse with the cotangent dS held the same way. Both sit
behind `jax.custom_vjp` on the state pass alone, so JAX differentiates the XLA parts around it as usual.

Per-value-channel beta has no W: each value channel j has its own system, whose right-hand side needs S, so the
kernels solve it per chunk (`_channel_solve`, forward substitution over the chunk's rows, vectorised over the
program's value channels; its VJP `_channel_backward`, backward substitution), reading v as U0, k_dec in W's
place, and A [Cp, Cp] and beta [Cp, BV] (float32):

    U[n][:, j] = (I + Diag(beta[n][:, j]) A[n])^{-1} Diag(beta[n][:, j]) (v[n][:, j] - k_dec[n] S[:, j])

With `FUSED_OUTPUT` (by default where the kernels compile) the output moves into the forward kernel
(`output_pass`): it also reads each chunk's q_dec [Cp, Kp] and P [Cp, Cp] and writes the output block

    O[n] = q_dec[n] S_in[n] + P[n] U[n]   [Cp, BV]

instead of S_in and U, which are then never written: per program and chunk, Kp x BV values fewer out (O replaces
U's block, S_in's goes), and Cp x (Kp + Cp) more in (every value block of a row reads the same q_dec and P,
as it reads W and k_end). That serves forward-only calls
(evaluation, prefill): its `jax.custom_vjp`'s forward rule, run only when the op is differentiated, is today's
program (the state-pass kernel writing S_in and U, the output in XLA), and its backward the backward kernel
after the VJP of that product. Segments need nothing of their own: their masks are in q_dec, P, k_end, decay.

With `BWD_STATES` (the default) the backward kernel carries only dS and writes each chunk's leaving-state cotangent
dS[n] [Kp, BV] and dU[n]; dW = -dU S_in^T, dk_end = U dS^T and ddecay = sum_v S_in * dS are then batched matmuls
in XLA over the whole of V (fla's split), instead of per-value-block partial sums from the kernel.

Under a multi-device `jax.jit` each kernel call is a `custom_partitioning` op whose sharding rule keeps the
sharding of the batch and value-head axes and replicates the rest, so every device runs the same kernel on its
own rows (XLA cannot split a kernel call itself and would gather the whole batch onto every device). Under
`jax.vmap` the mapped axis is folded into the batch (`pallas_common.batched_rows`).

For bfloat16 callers the arrays the kernels read and write (U0, W, k_end, S_in, U; q_dec, P, O) are bfloat16 and
each matmul rounds its state-side operand to bfloat16; the state and every accumulation are float32
(`BF16_OPERANDS`). O is written in the op's output dtype where that is 16-bit (the one rounding the output gets
anyway), else float32.

The kernels use the Pallas Triton lowering on GPU (ref indexing, `lax.fori_loop`, `lax.dot_general`: nothing
backend-specific in the kernel bodies) and Pallas' interpreter everywhere else; docs/ops.md says why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops import checks, intra_chunk, pallas_local
from gdn.ops.chunk import STATES, WRITES, chunk_outputs, finish, initial, isolate_segments, prepare, unchunk
from gdn.ops.pallas_common import batched_rows, default_interpret, kernel_precision, per_rows
from gdn.ops.pallas_common import pow2 as _pow2

BLOCK_V = 64  # value channels per program: a [128, 64] float32 state is 64 registers a thread at 4 warps
# bfloat16 callers (DEFAULT precision) get bfloat16 operands in HBM (U0, W, k_end, and the S_in and U the
# forward writes): the forward state pass is bound by these bytes. The state and all accumulation stay float32.
BF16_OPERANDS = True
BWD_STAGES_BF16 = 2  # pipeline stages of the backward kernel on bfloat16 operands (float32 ones fit only one)
# The chunk-local work (`chunk.prepare`) as the fused Pallas kernel of `pallas_local` (per-head decay and beta
# without segments, and per-key-channel decay with `pallas_local.FUSED_LOCAL_CHANNEL`; other variants stay in XLA)
# in forward-only calls: True, False, or None = where the Pallas kernels compile (not in the interpreter, whose
# per-program loop would only slow CPU runs down). On the H200 it took the op's forward from 1.03 to 0.76 ms at
# (4, 2048, 16, 128) (docs/benchmarks.md).
FUSED_LOCAL: Optional[bool] = None
# The output O = Q_dec S_in + P U computed inside the forward state-pass kernel (`output_pass`), so that S_in and
# U are never written, in forward-only calls (differentiated calls run today's program: see `_output_pass_fwd`):
# True, False, or None = where the Pallas kernels compile, as FUSED_LOCAL. On the H200 it took the op's bfloat16
# forward from 0.84 to 0.63 ms at (4, 2048, 16, 128) and from 3.91 to 3.44 at (4, 4096, 64, 128) (docs/benchmarks.md).
FUSED_OUTPUT: Optional[bool] = None
SUB = 16  # rows of a block of the per-value-channel solve (`_channel_solve`): Triton's smallest dot dimension
# The backward kernel's results (per-head beta or no delta rule; per-value-channel beta keeps today's kernel):
# True, the cotangent of the state leaving each chunk, dS [Kp, BV] per chunk in the operand dtype (what fla's
# backward state kernel writes), and dW = -dU S_in^T, dk_end = U dS^T and ddecay = sum_v S_in * dS from it in
# XLA, batched matmuls over the whole of V; the kernel then reads neither S_in nor U and holds one state-sized
# block in registers. False, the kernel computes those three products per value block and writes them as float32
# partial sums [L, V / BV, N, Cp, Kp] that XLA adds up: at K = 256, V = 512 (the 340M model) eight of them per
# chunk. On the H200 (bfloat16) True took the op's forward+backward to 0.92-0.96x at the five benchmark shapes and
# the 340M model's step from 533.6 to 510.0 ms and 39.4 to 37.2 GiB (docs/benchmarks.md).
BWD_STATES = True
# With BWD_STATES and the output computed by `output_pass` (FUSED_OUTPUT) in a differentiated call: True, the
# backward kernel forms each chunk's share of the state cotangent from the output, q_dec^T dO [Kp, BV], itself from
# q_dec and dO, as fla's backward state kernel does, so that XLA never writes that cotangent dS_in
# [.., N, Kp, Vp] (at K = 256, V = 512 a state-sized array per chunk, as large as S_in); False, XLA's VJP of the
# output product writes it and the kernel reads it. Read at trace time. Off: timed only together with
# BWD_PRODUCTS (below), which together left the 340M model's step where it was.
BWD_FROM_OUTPUT = False
# With BWD_STATES: True, the products of the per-chunk states with the backward's cotangents, dW = -dU S_in^T,
# dk_end = U dS^T, ddecay = sum_v S_in * dS and, in a differentiated output pass, dq_dec = dO S_in^T, as one Pallas
# kernel parallel over rows, chunks and blocks of PRODUCTS_BLOCK_K keys (fla's chunk_bwd_dqkwg): it reads S_in and
# dS once per chunk, where XLA's matmuls and reduction read S_in three times and dS twice (at K = 256, V = 512 each
# read is a state-sized array per chunk). False, those products in XLA (`_from_states`, the output's VJP). Read at
# trace time. Off: on the H200 (bfloat16) it made the op's forward+backward 1.03-1.06x slower at K = V = 128, and
# with BWD_FROM_OUTPUT the 340M model's step 490.5 against 491.3 ms, peak 37.2 against 37.9 GiB (docs/benchmarks.md).
BWD_PRODUCTS = False
PRODUCTS_BLOCK_K = 64  # key rows per program of that kernel (at most the padded K)
PRODUCTS_NUM_WARPS = 8  # and its warps (offline for sm_90, 64 keys: 134-138 registers, no spill; four warps spill)
# Launch settings for keys wider than 128 (the paper models' head dim 256): True, value blocks of 32 and eight
# warps for the state-pass kernels (two pipeline stages on bfloat16 operands for the forward and dS ones), and eight
# warps for the fused chunk-local kernel. Offline for sm_90 (Triton 3.9, ptxas -v, bfloat16, K = 256, V = 512;
# `experiments/kernel_resources.py`) these spill nothing, where the K = 128 launch (blocks of 64, four warps) spills
# 100-800 bytes in every kernel. False: the K = 128 launch at every width. Off: on the H200 it made the 340M
# model's step slower despite the spills it removes, 533.6 -> 633.4 ms alone and 510.0 -> 528.3 ms with BWD_STATES
# (docs/benchmarks.md).
WIDE_KEYS = False
# Value blocks of 32 instead of BLOCK_V's 64 in the state-pass kernels where the grid, B * HV programs per value
# block, would have fewer programs than the card has streaming multiprocessors (`narrow_below`): each program
# walks all N chunks in turn, so at (2, 16384, 16, 128) 64 programs leave half the card idle (the dS kernel took
# 1.09 ms there against 0.54 ms for fla's, which autotunes blocks of 32 or 64; docs/benchmarks.md). On: in one
# process on the H200 it took forward+backward from 7.295 to 6.815 ms at (2, 16384, 16, 128) and 2.147 to 2.082
# at (4, 2048, 16, 128), where (1, 8192, 96, 128), above the bound, moved 1.7% (narrow_blocks.txt in
# results/benchmarks/h200_2026-12-02).
NARROW_BLOCKS = True
# The bound: None reads the default device's multiprocessor count (`core_count`, 132 on the H200), or 132 where
# the device has none (the CPU, running the kernels in Pallas' interpreter); an int sets it.
NARROW_BELOW = None


def narrow_below() -> int:
  """The program count below which NARROW_BLOCKS narrows the value blocks (NARROW_BELOW, or the device's)."""
  if NARROW_BELOW is not None:
    return NARROW_BELOW
  return getattr(jax.devices()[0], "core_count", None) or 132


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one state pass (hashable: a `nondiff_argnums` of the custom VJP)."""
  prec: jax.lax.Precision | jax.lax.DotAlgorithmPreset  # see `kernel_precision`
  block_v: int
  interpret: bool
  delta: bool  # False without the delta rule (no W): then U = U0 and the kernels skip its matmul
  operands: str = "float32"  # dtype of U0, W, k_end, S_in and U (and q_dec, P, O) in memory; the state is float32
  output: bool = False  # the forward kernel reads q_dec and P and writes O instead of S_in and U (FUSED_OUTPUT)
  out_dtype: str = "float32"  # O's dtype in memory
  out_prec: Optional[jax.lax.Precision] = None  # the caller's precision: the XLA output's in a differentiated call
  channel: bool = False  # per-value-channel beta: the W slot holds k_dec, and A and beta come too (`_channel_solve`)
  states_bwd: bool = False  # BWD_STATES: the backward kernel writes dS per chunk; dW, dk_end, ddecay in XLA
  from_output: bool = False  # BWD_FROM_OUTPUT: that kernel forms q_dec^T dO itself (a differentiated output pass)
  xla_prec: Optional[jax.lax.Precision] = None  # the caller's precision, for those products in XLA
  wide: bool = False  # WIDE_KEYS at Kp > 128: eight warps where a state-sized block lives in registers
  products: bool = False  # BWD_PRODUCTS: dW, dk_end, ddecay (and dq_dec) from S_in and dS in one kernel
  products_block_k: int = 64  # PRODUCTS_BLOCK_K, at most Kp
  products_warps: int = 8  # PRODUCTS_NUM_WARPS


def _dot(a, b, ta: bool, tb: bool, prec):
  """a @ b with a or b read transposed, accumulated in float32 (2-D operands only, as Triton wants)."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _channel_solve(n, S_op, u0_ref, kdec_ref, a_ref, beta_ref, prec):
  """Per-value-channel beta: chunk n's write vectors for the program's value channels j,

      u_j = (I + Diag(beta_j) A)^{-1} Diag(beta_j) (v_j - k_dec S_j),
      i.e. row by row   u_t = beta_t (v_t - k_dec_t S - sum_{i<t} A_ti u_i),

  as `chunk._solve_channel_beta` solves them, by forward substitution vectorised over the channels. Rows go in
  blocks of SUB: the earlier blocks enter a block by matmuls, its own rows one at a time in a `fori_loop` (a row
  of a value is picked by an iota mask: Triton cannot index a value). Returns [(rows, U_b [SUB, BV] float32)]."""
  f32 = jnp.float32
  row = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  row_v = jax.lax.broadcasted_iota(jnp.int32, (SUB, u0_ref.shape[-1]), 0)
  blocks = []
  for b in range(a_ref.shape[-1] // SUB):
    rows = pl.ds(b * SUB, SUB)
    X = u0_ref[n, rows, :].astype(f32) - _dot(kdec_ref[n, rows, :], S_op, False, False, prec)  # [SUB, BV]
    for cols, U_m in blocks:
      X = X - _dot(a_ref[n, rows, cols], U_m, False, False, prec)
    A_bb = a_ref[n, rows, rows].astype(f32)
    beta = beta_ref[n, rows, :].astype(f32)

    def step(r, X, A_bb=A_bb, beta=beta):  # rows before r hold u, rows from r on what is left of v - k_dec S
      a = jnp.sum(jnp.where(row == r, A_bb, 0.0), axis=0)[:, None]  # [SUB, 1]: A_ri, zero from i = r on
      return jnp.where(row_v == r, beta * (X - jnp.sum(a * X, axis=0, keepdims=True)), X)

    blocks.append((rows, jax.lax.fori_loop(0, SUB, step, X)))
  return blocks


def _forward_kernel(*refs, cfg: Config, N: int):
  """One program's chunks in order. Refs: U0, W (delta rule only; k_dec with cfg.channel), k_end, decay, S0, then
  q_dec, P (cfg.output only), A, beta (cfg.channel only); results S_in and U (U with the delta rule only), or with
  cfg.output the output O; last S_T."""
  refs = list(refs)
  take = lambda present=True: refs.pop(0) if present else None
  u0_ref, w_ref, kend_ref, decay_ref, s0_ref = take(), take(cfg.delta), take(), take(), take()
  qdec_ref, p_ref = take(cfg.output), take(cfg.output)
  a_ref, beta_ref = take(cfg.channel), take(cfg.channel)
  s_in_ref, u_ref, o_ref = take(not cfg.output), take(cfg.delta and not cfg.output), take(cfg.output)
  s_t_ref = take()

  odt = jnp.dtype(cfg.operands)
  Cp = u0_ref.shape[-2]

  def body(n, S):
    S_op = S.astype(odt)  # the matmul operand (and S_in as written); S itself stays float32
    if s_in_ref is not None:
      s_in_ref[n] = S_op
    if cfg.channel:
      blocks = _channel_solve(n, S_op, u0_ref, w_ref, a_ref, beta_ref, cfg.prec)
    else:  # one block of all Cp rows
      U = u0_ref[n].astype(jnp.float32)
      if cfg.delta:
        U = U - _dot(w_ref[n], S_op, False, False, cfg.prec)  # [Cp, BV]
      blocks = [(pl.ds(0, Cp), U)]
    blocks = [(rows, U, U.astype(odt)) for rows, U in blocks]
    kS = None
    for b, (rows, U, U_op) in enumerate(blocks):
      if u_ref is not None:
        u_ref[n, rows, :] = U.astype(u_ref.dtype)
      if o_ref is not None:  # chunk n's output: q_dec S_in + P U, what `chunk.finish` computes from S_in and U
        O = _dot(qdec_ref[n, rows, :], S_op, False, False, cfg.prec)
        for cols, _, U_m in blocks[:b + 1]:  # P is lower triangular
          O = O + _dot(p_ref[n, rows, cols], U_m, False, False, cfg.prec)
        o_ref[n, rows, :] = O.astype(o_ref.dtype)  # [rows, BV]
      kS_b = _dot(kend_ref[n, rows, :], U_op, True, False, cfg.prec)  # k_end^T U: [Kp, BV]
      kS = kS_b if kS is None else kS + kS_b
    return decay_ref[n].astype(jnp.float32)[:, None] * S + kS

  S = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(jnp.float32))
  s_t_ref[...] = S.astype(s_t_ref.dtype)


def _channel_backward(n, S_op, dS_op, refs, prec):
  """The VJP of `_channel_solve` and of k_end^T U for chunk n, from dU = dU_ext + k_end dS (dS leaving the chunk).
  With X = v - k_dec S, y = X - A U (so U = beta * y) and Z = beta * dR, dR solving
  (I + A^T Diag(beta_j)) dR_j = dU_j (backward substitution, in blocks of SUB rows in reverse, as `_channel_solve`
  goes forward):
    dv = Z;  dbeta = dR * y;  dk_dec = -Z S^T;  dA = -strictly-lower(Z U^T);  dS gets -k_dec^T Z (the caller's).
  Writes dv, dbeta, dk_dec and dA (this program's value channels' share); returns [(rows, Z [SUB, BV] float32)]."""
  kdec_ref, kend_ref, u0_ref, u_ref, a_ref, beta_ref, du_ref, du0_ref, dbeta_ref, dw_ref, da_ref = refs
  f32 = jnp.float32
  iota = lambda shape, axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis)
  col, strict = iota((SUB, SUB), 1), iota((SUB, SUB), 0) > iota((SUB, SUB), 1)
  row_v = iota((SUB, du_ref.shape[-1]), 0)
  spans = [pl.ds(b * SUB, SUB) for b in range(a_ref.shape[-1] // SUB)]
  U = [u_ref[n, rows, :].astype(f32) for rows in spans]
  Z = {}
  for b in reversed(range(len(spans))):
    rows = spans[b]
    dR = du_ref[n, rows, :].astype(f32) + _dot(kend_ref[n, rows, :], dS_op, False, False, prec)  # dU
    for m in range(b + 1, len(spans)):
      dR = dR - _dot(a_ref[n, spans[m], rows], Z[m], True, False, prec)  # A_mb^T Z_m
    A_bb = a_ref[n, rows, rows].astype(f32)
    beta = beta_ref[n, rows, :].astype(f32)

    def step(i, dR, A_bb=A_bb, beta=beta):  # rows after r hold dR, rows up to r what is left of dU
      r = SUB - 1 - i
      a = jnp.sum(jnp.where(col == r, A_bb, 0.0), axis=1)[:, None]  # [SUB, 1]: A_tr, zero up to t = r
      return jnp.where(row_v == r, dR - jnp.sum(a * beta * dR, axis=0, keepdims=True), dR)

    dR = jax.lax.fori_loop(0, SUB, step, dR)
    Z[b] = beta * dR
    y = u0_ref[n, rows, :].astype(f32) - _dot(kdec_ref[n, rows, :], S_op, False, False, prec)
    for m in range(b + 1):
      y = y - _dot(a_ref[n, rows, spans[m]], U[m], False, False, prec)
    du0_ref[n, rows, :] = Z[b].astype(du0_ref.dtype)
    dbeta_ref[n, rows, :] = (dR * y).astype(dbeta_ref.dtype)
    dw_ref[n, rows, :] = (-_dot(Z[b].astype(S_op.dtype), S_op, False, True, prec)).astype(dw_ref.dtype)
    for m, cols in enumerate(spans):
      dA = -_dot(Z[b], U[m], False, True, prec) if m <= b else jnp.zeros((SUB, SUB), f32)
      da_ref[n, rows, cols] = (jnp.where(strict, dA, 0.0) if m == b else dA).astype(da_ref.dtype)
  return [(rows, Z[b]) for b, rows in enumerate(spans)]


def _backward_kernel(*refs, cfg: Config, N: int):
  """The chunks in reverse. Refs: W (delta rule only; k_dec with cfg.channel), k_end, decay, S_in, U, dS_in, dU,
  dS_T, then v, A, beta (cfg.channel only); results dU0 (dv with cfg.channel), dbeta (cfg.channel), dW, dk_end,
  ddecay, dA (cfg.channel; the K- and C-side ones this program's part), dS0."""
  refs = list(refs)
  take = lambda present=True: refs.pop(0) if present else None
  w_ref, kend_ref, decay_ref, s_in_ref, u_ref = take(cfg.delta), take(), take(), take(), take()
  ds_in_ref, du_ref, ds_t_ref = take(), take(), take()
  u0_ref, a_ref, beta_ref = take(cfg.channel), take(cfg.channel), take(cfg.channel)
  du0_ref, dbeta_ref, dw_ref, dkend_ref, ddecay_ref = take(), take(cfg.channel), take(cfg.delta), take(), take()
  da_ref, ds0_ref = take(cfg.channel), take()

  odt = jnp.dtype(cfg.operands)

  def body(i, dS):  # dS: the cotangent of the state leaving chunk n
    n = N - 1 - i
    S = s_in_ref[n]
    dS_op = dS.astype(odt)  # the matmul operand; dS itself stays float32
    dkend_ref[n] = _dot(u_ref[n], dS_op, False, True, cfg.prec).astype(dkend_ref.dtype)  # U dS^T: [Cp, Kp]
    ddecay_ref[n] = jnp.sum(S.astype(jnp.float32) * dS, axis=1).astype(ddecay_ref.dtype)
    dS_prev = decay_ref[n].astype(jnp.float32)[:, None] * dS + ds_in_ref[n].astype(jnp.float32)
    if cfg.channel:
      solve_refs = (w_ref, kend_ref, u0_ref, u_ref, a_ref, beta_ref, du_ref, du0_ref, dbeta_ref, dw_ref, da_ref)
      for rows, Z in _channel_backward(n, S, dS_op, solve_refs, cfg.prec):
        dS_prev = dS_prev - _dot(w_ref[n, rows, :], Z.astype(odt), True, False, cfg.prec)  # k_dec^T Z
      return dS_prev
    dU = du_ref[n].astype(jnp.float32) + _dot(kend_ref[n], dS_op, False, False, cfg.prec)  # [Cp, BV]
    du0_ref[n] = dU.astype(du0_ref.dtype)
    if cfg.delta:
      dU_op = dU.astype(odt)
      dw_ref[n] = (-_dot(dU_op, S, False, True, cfg.prec)).astype(dw_ref.dtype)  # -dU S^T: [Cp, Kp]
      dS_prev = dS_prev - _dot(w_ref[n], dU_op, True, False, cfg.prec)  # W^T dU
    return dS_prev

  dS = jax.lax.fori_loop(0, N, body, ds_t_ref[...].astype(jnp.float32))
  ds0_ref[...] = dS.astype(ds0_ref.dtype)


def _backward_states_kernel(*refs, cfg: Config, N: int):
  """BWD_STATES' backward: the chunks in reverse, carrying only dS. Refs: W (delta rule only), k_end, decay,
  dS_in (with cfg.from_output q_dec and dO in its place: dS_in = q_dec^T dO per chunk), dU, dS_T; results dU0
  (dU + k_end dS), dS (the cotangent of the state leaving each chunk) and dS0."""
  refs = list(refs)
  take = lambda present=True: refs.pop(0) if present else None
  w_ref, kend_ref, decay_ref = take(cfg.delta), take(), take()
  ds_in_ref = take(not cfg.from_output)
  qdec_ref, do_ref = take(cfg.from_output), take(cfg.from_output)
  du_ref, ds_t_ref = take(), take()
  du0_ref, ds_ref, ds0_ref = take(), take(), take()
  odt = jnp.dtype(cfg.operands)
  f32 = jnp.float32

  def body(i, dS):
    n = N - 1 - i
    dS_op = dS.astype(odt)
    ds_ref[n] = dS_op.astype(ds_ref.dtype)
    dU = du_ref[n].astype(f32) + _dot(kend_ref[n], dS_op, False, False, cfg.prec)  # [Cp, BV]
    du0_ref[n] = dU.astype(du0_ref.dtype)
    if cfg.from_output:  # q_dec^T dO [Kp, BV]
      ds_in = _dot(qdec_ref[n], do_ref[n].astype(odt), True, False, cfg.prec)
    else:
      ds_in = ds_in_ref[n].astype(f32)
    dS_prev = decay_ref[n].astype(f32)[:, None] * dS + ds_in
    if cfg.delta:
      dS_prev = dS_prev - _dot(w_ref[n], dU.astype(odt), True, False, cfg.prec)  # W^T dU
    return dS_prev

  dS = jax.lax.fori_loop(0, N, body, ds_t_ref[...].astype(f32))
  ds0_ref[...] = dS.astype(ds0_ref.dtype)


def _call(kernel, cfg: Config, grid, ins, in_specs, outs, out_specs, name, num_warps, num_stages):
  return pl.pallas_call(
      kernel, out_shape=outs, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=cfg.interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages), name=name)(*ins)


def _specs(L, N, Cp, Kp, BV):
  """BlockSpecs over the grid (L, Vp / BV): per-chunk arrays keep all N chunks in the block (the kernel walks
  them), V-indexed arrays take the program's value block, K-only arrays are shared by the value blocks."""
  per_v = lambda rows: pl.BlockSpec((None, N, rows, BV), lambda i, j: (i, 0, 0, j))
  per_k = pl.BlockSpec((None, N, Cp, Kp), lambda i, j: (i, 0, 0, 0))
  decay = pl.BlockSpec((None, N, Kp), lambda i, j: (i, 0, 0))
  state = pl.BlockSpec((None, Kp, BV), lambda i, j: (i, 0, j))
  # Per-program partial sums of the K-side cotangents, summed over value blocks in XLA.
  part_k = pl.BlockSpec((None, None, N, Cp, Kp), lambda i, j: (i, j, 0, 0, 0))
  part_decay = pl.BlockSpec((None, None, N, Kp), lambda i, j: (i, j, 0, 0))
  return per_v, per_k, decay, state, part_k, part_decay


def _forward_call(cfg: Config, U0, W, k_end, decay, S0, q_dec=None, P=None, A=None, beta=None):
  """The forward kernel on operands [B, HV, ...]: (S_in, U, S_T) [B, HV, ...], or (S_in, S_T) without W; with
  cfg.output, which reads q_dec and P, (O, S_T). With cfg.channel W is k_dec, and A and beta are read too."""
  B, HV, N, Cp, Vp = U0.shape
  L, Kp, BV = B * HV, k_end.shape[-1], cfg.block_v
  per_v, per_k, dec, state, _, _ = _specs(L, N, Cp, Kp, BV)
  per_c = pl.BlockSpec((None, N, Cp, Cp), lambda i, j: (i, 0, 0, 0))  # P and A, shared by the value blocks
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  op = lambda *s: jax.ShapeDtypeStruct(s, jnp.dtype(cfg.operands))
  ins = ([U0] + ([W] if cfg.delta else []) + [k_end, decay, S0] + ([q_dec, P] if cfg.output else [])
         + ([A, beta] if cfg.channel else []))
  in_specs = ([per_v(Cp)] + ([per_k] if cfg.delta else []) + [per_k, dec, state]
              + ([per_k, per_c] if cfg.output else []) + ([per_c, per_v(Cp)] if cfg.channel else []))
  if cfg.output:
    outs = [jax.ShapeDtypeStruct((L, N, Cp, Vp), jnp.dtype(cfg.out_dtype)), f32(L, Kp, Vp)]
    out_specs = [per_v(Cp), state]
  else:
    outs = [op(L, N, Kp, Vp)] + ([op(L, N, Cp, Vp)] if cfg.delta else []) + [f32(L, Kp, Vp)]
    out_specs = [per_v(Kp)] + ([per_v(Cp)] if cfg.delta else []) + [state]
  # Two stages let Triton prefetch chunk n + 1's W, k_end and U0 while chunk n computes: about 200 KB of
  # shared memory at K = 128, C = BV = 64 (Triton 3.9, sm_90), under the H200's 227 KB; one stage beyond. With
  # the output, q_dec and P join them: two stages where one stage's blocks take at most the 80 KiB of that case
  # (float32 there), which bfloat16 operands meet at the same sizes and float32 ones do not. Per-value-channel
  # beta adds A and beta (float32) and is held to the same 80 KiB (not yet compiled on a card).
  if cfg.output or cfg.channel:
    per_k_blocks = 1 + cfg.delta + cfg.output  # k_end, W or k_dec, q_dec
    stage_bytes = (jnp.dtype(cfg.operands).itemsize * (Cp * BV + per_k_blocks * Cp * Kp + cfg.output * Cp * Cp)
                   + 4 * cfg.channel * (Cp * Cp + Cp * BV))
    stages = 2 if stage_bytes <= 80 * 1024 else 1
  else:
    stages = _plain_stages(cfg, Cp, Kp, BV)
  res = _call(functools.partial(_forward_kernel, cfg=cfg, N=N), cfg, (L, Vp // BV), [_rows(x) for x in ins],
              in_specs, outs, out_specs, "gdn_chunk_output_fwd" if cfg.output else "gdn_chunk_states_fwd",
              8 if cfg.wide else 4, stages)
  return tuple(_unrows(r, B) for r in res)


def _backward_call(cfg: Config, W, k_end, decay, S_in, U, dS_in, dU, dS_T, U0=None, A=None, beta=None):
  """The backward kernel on operands [B, HV, ...]: (dU0, dW, dk_end, ddecay, dS0) [B, HV, ...], without dW
  when there is no W; with cfg.channel (which reads U0, A and beta too) (dU0, dW, dk_end, ddecay, dA, dS0,
  dbeta)."""
  B, HV, N, Cp, Vp = U.shape
  L, Kp, BV = B * HV, k_end.shape[-1], cfg.block_v
  NV = Vp // BV
  per_v, per_k, dec, state, part_k, part_decay = _specs(L, N, Cp, Kp, BV)
  per_c = pl.BlockSpec((None, N, Cp, Cp), lambda i, j: (i, 0, 0, 0))
  part_c = pl.BlockSpec((None, None, N, Cp, Cp), lambda i, j: (i, j, 0, 0, 0))
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  ins = ([W] if cfg.delta else []) + [k_end, decay, S_in, U, dS_in, dU, dS_T] + ([U0, A, beta] if cfg.channel else [])
  in_specs = (([per_k] if cfg.delta else []) + [per_k, dec, per_v(Kp), per_v(Cp), per_v(Kp), per_v(Cp), state]
              + ([per_v(Cp), per_c, per_v(Cp)] if cfg.channel else []))
  outs = ([f32(L, N, Cp, Vp)] * (1 + cfg.channel) + ([f32(L, NV, N, Cp, Kp)] if cfg.delta else [])
          + [f32(L, NV, N, Cp, Kp), f32(L, NV, N, Kp)] + ([f32(L, NV, N, Cp, Cp)] if cfg.channel else [])
          + [f32(L, Kp, Vp)])
  out_specs = ([per_v(Cp)] * (1 + cfg.channel) + ([part_k] if cfg.delta else []) + [part_k, part_decay]
               + ([part_c] if cfg.channel else []) + [state])
  # On float32 operands one stage: two would take about 256 KB of shared memory at K = 128, C = BV = 64, over
  # the H200's 227 KB; bfloat16 operands halve that. Eight warps: the state and its cotangent both live in
  # registers; at four the compiled kernel spilled. Per-value-channel beta: one stage (it reads A, v and beta
  # too; not yet compiled on a card).
  small = Cp * Kp <= 64 * 128 and BV <= 64
  stages = BWD_STAGES_BF16 if cfg.operands == "bfloat16" and small and not cfg.channel else 1
  res = _call(functools.partial(_backward_kernel, cfg=cfg, N=N), cfg, (L, NV), [_rows(x) for x in ins],
              in_specs, outs, out_specs, "gdn_chunk_states_bwd", 8, stages)
  # The K- and C-side cotangents come per value block; their sum stays inside, so it runs on each device's rows
  # too.
  dU0, *res = res
  dbeta = [res.pop(0)] if cfg.channel else []
  *parts, dS0 = res
  return tuple(_unrows(r, B) for r in [dU0] + [p.sum(1) for p in parts] + [dS0] + dbeta)


def _plain_stages(cfg: Config, Cp: int, Kp: int, BV: int) -> int:
  """Pipeline stages of the forward (without the output or the per-channel solve) and dS kernels: two where one
  stage's W, k_end and value block fit as at K = 128, C = BV = 64, or (WIDE_KEYS) on bfloat16 operands with value
  blocks of 32 (about 156 KiB of shared memory at K = 256, C = 64); else one."""
  if cfg.wide:
    return 2 if cfg.operands == "bfloat16" and BV <= 32 else 1
  return 2 if Cp * Kp <= 64 * 128 and BV <= 64 else 1


def _backward_states_call(cfg: Config, W, k_end, decay, dS_in, dU, dS_T):
  """BWD_STATES' backward kernel on operands [B, HV, ...]: (dU0, dS, dS0) [B, HV, ...], dS [.., N, Kp, Vp] in
  the operand dtype. With cfg.from_output dS_in is the pair (q_dec [.., N, Cp, Kp], dO [.., N, Cp, Vp])."""
  B, HV, N, Cp, Vp = dU.shape
  L, Kp, BV = B * HV, k_end.shape[-1], cfg.block_v
  per_v, per_k, dec, state, _, _ = _specs(L, N, Cp, Kp, BV)
  ds_in, ds_in_specs = (list(dS_in), [per_k, per_v(Cp)]) if cfg.from_output else ([dS_in], [per_v(Kp)])
  ins = ([W] if cfg.delta else []) + [k_end, decay] + ds_in + [dU, dS_T]
  in_specs = ([per_k] if cfg.delta else []) + [per_k, dec] + ds_in_specs + [per_v(Cp), state]
  outs = [jax.ShapeDtypeStruct((L, N, Cp, Vp), jnp.float32),
          jax.ShapeDtypeStruct((L, N, Kp, Vp), jnp.dtype(cfg.operands)), jax.ShapeDtypeStruct((L, Kp, Vp), jnp.float32)]
  out_specs = [per_v(Cp), per_v(Kp), state]
  # As the forward: one state-sized block (dS) in registers, at four warps (eight with WIDE_KEYS), and the
  # forward's pipeline stages.
  res = _call(functools.partial(_backward_states_kernel, cfg=cfg, N=N), cfg, (L, Vp // BV), [_rows(x) for x in ins],
              in_specs, outs, out_specs, "gdn_chunk_dstates_bwd", 8 if cfg.wide else 4,
              _plain_stages(cfg, Cp, Kp, BV))
  return tuple(_unrows(r, B) for r in res)


def _from_states(cfg: Config, S_in, U, dU, dS):
  """BWD_STATES: dW = -dU S_in^T, dk_end = U dS^T [.., N, Cp, Kp] and ddecay = sum_v S_in * dS [.., N, Kp] in
  XLA, from operand-dtype factors (as the kernels round them) with float32 accumulation; dW None without W."""
  odt = jnp.dtype(cfg.operands)
  mm = lambda a, b: jnp.einsum("...cv,...kv->...ck", a.astype(odt), b.astype(odt), precision=cfg.xla_prec,
                               preferred_element_type=jnp.float32)
  dW = -mm(dU, S_in) if cfg.delta else None
  ddecay = jnp.sum(S_in.astype(jnp.float32) * dS.astype(jnp.float32), axis=-1)
  return dW, mm(U, dS), ddecay


def _products_kernel(*refs, cfg: Config, NV: int, BV: int, with_q: bool):
  """BWD_PRODUCTS: one chunk's products with its states for a block of BK key rows, the value channels in blocks of
  BV. Refs: S_in [BK, Vp], dS [BK, Vp], U [Cp, Vp], dU0 [Cp, Vp] (delta rule only), dO [Cp, Vp] (with_q only);
  results dW = -dU0 S_in^T (delta rule only), dk_end = U dS^T [Cp, BK], ddecay = sum_v S_in * dS [BK], and dq_dec =
  dO S_in^T [Cp, BK] (with_q only), float32. Operands rounded to the operand dtype as `_from_states` rounds them;
  every sum is float32."""
  refs = list(refs)
  take = lambda present=True: refs.pop(0) if present else None
  s_ref, ds_ref, u_ref, du_ref, do_ref = take(), take(), take(), take(cfg.delta), take(with_q)
  dw_ref, dk_ref, dd_ref, dq_ref = take(cfg.delta), take(), take(), take(with_q)
  odt, f32 = jnp.dtype(cfg.operands), jnp.float32
  Cp, BK = dk_ref.shape
  products = lambda a_ref, cols, b: _dot(a_ref[:, cols].astype(odt), b, False, True, cfg.prec)  # [Cp, BK]

  def body(j, acc):
    cols = pl.ds(pl.multiple_of(j * BV, BV), BV)
    S, dS = s_ref[:, cols].astype(odt), ds_ref[:, cols].astype(odt)
    acc = dict(acc)
    acc["dk"] = acc["dk"] + products(u_ref, cols, dS)
    acc["dd"] = acc["dd"] + jnp.sum(S.astype(f32) * dS.astype(f32), axis=1)
    if cfg.delta:
      acc["dw"] = acc["dw"] - products(du_ref, cols, S)
    if with_q:
      acc["dq"] = acc["dq"] + products(do_ref, cols, S)
    return acc

  zeros = jnp.zeros((Cp, BK), f32)
  acc = {"dk": zeros, "dd": jnp.zeros((BK,), f32)}
  acc.update({"dw": zeros} if cfg.delta else {})
  acc.update({"dq": zeros} if with_q else {})
  acc = jax.lax.fori_loop(0, NV, body, acc)
  dk_ref[...] = acc["dk"].astype(dk_ref.dtype)
  dd_ref[...] = acc["dd"].astype(dd_ref.dtype)
  if cfg.delta:
    dw_ref[...] = acc["dw"].astype(dw_ref.dtype)
  if with_q:
    dq_ref[...] = acc["dq"].astype(dq_ref.dtype)


def _products_call(cfg: Config, S_in, dS, U, *rest):
  """BWD_PRODUCTS' kernel on operands [B, HV, ...]: S_in, dS, U, then dU0 with the delta rule, then dO for dq_dec.
  Returns (dW (delta rule only), dk_end, ddecay, dq_dec (with dO only)) [B, HV, ...], float32. The grid (K blocks,
  N, L) puts a chunk's key blocks next to each other in the launch order (the first grid axis varies fastest), so
  the value-side blocks they share (U, dU0, dO) come from the L2 cache after the first."""
  B, HV, N, Kp, Vp = S_in.shape
  Cp = U.shape[-2]
  L, BV, BK = B * HV, cfg.block_v, min(cfg.products_block_k, Kp)
  with_q = len(rest) > cfg.delta
  states = pl.BlockSpec((None, None, BK, Vp), lambda kb, n, r: (r, n, kb, 0))
  rows = pl.BlockSpec((None, None, Cp, Vp), lambda kb, n, r: (r, n, 0, 0))
  per_k = pl.BlockSpec((None, None, Cp, BK), lambda kb, n, r: (r, n, 0, kb))
  per_key = pl.BlockSpec((None, None, BK), lambda kb, n, r: (r, n, kb))
  ins = [S_in, dS, U, *rest]
  in_specs = [states, states] + [rows] * (1 + len(rest))
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  outs = [f32(L, N, Cp, Kp)] * cfg.delta + [f32(L, N, Cp, Kp), f32(L, N, Kp)] + [f32(L, N, Cp, Kp)] * with_q
  out_specs = [per_k] * cfg.delta + [per_k, per_key] + [per_k] * with_q
  res = _call(functools.partial(_products_kernel, cfg=cfg, NV=Vp // BV, BV=BV, with_q=with_q), cfg,
              (Kp // BK, N, L), [_rows(x) for x in ins], in_specs, outs, out_specs, "gdn_chunk_products_bwd",
              cfg.products_warps, 2)
  return tuple(_unrows(r, B) for r in res)


def _products(cfg: Config, S_in, U, dU0, dS, dO=None):
  """(dW, dk_end, ddecay, dq_dec) from `_products_call` through its per-rows op (by delta rule and dq_dec); dW None
  without the delta rule, dq_dec None without dO."""
  args = [S_in, dS, U] + ([dU0] if cfg.delta else []) + ([dO] if dO is not None else [])
  res = list(batched_rows(_PRODUCTS[cfg.delta, dO is not None], cfg, *args))
  dW = res.pop(0) if cfg.delta else None
  dk_end, ddecay = res.pop(0), res.pop(0)
  return dW, dk_end, ddecay, (res.pop(0) if dO is not None else None)


def _rows(x):
  """[B, HV, ...] -> [L, ...], the kernels' grid axis (a free reshape)."""
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _unrows(x, B: int):
  """[L, ...] -> [B, HV, ...]."""
  return x.reshape((B, x.shape[0] // B) + x.shape[1:])


_per_rows = functools.partial(per_rows, lead=2)  # the rows: the leading (B, HV) axes


def _rule(ins: str, outs: str) -> str:
  """An einsum-like sharding rule from the trailing axes of each array; every array leads with b h."""
  lead = lambda axes: ", ".join("b h " + a for a in axes.split(","))
  return f"{lead(ins)} -> {lead(outs)}"


def _forward_rule(delta: bool, output: bool, channel: bool) -> str:
  """`_forward_call`'s sharding rule for one operand list (the factor i: P's and A's second C axis)."""
  ins = (["n c v"] + ["n c k"] * delta + ["n c k", "n k", "k v"] + ["n c k", "n c i"] * output
         + ["n c i", "n c v"] * channel)
  outs = ["n c v"] if output else ["n k v"] + ["n c v"] * delta
  return _rule(",".join(ins), ",".join(outs + ["k v"]))


# One op per operand list: without the delta rule there is no W (nor U among the forward results, nor dW); the
# forward with the output reads q_dec and P and returns O; per-value-channel beta reads A and beta too.
_FORWARD = {(delta, output, channel): _per_rows(_forward_call, _forward_rule(delta, output, channel))
            for delta in (True, False) for output in (True, False) for channel in (delta, False)}
_BACKWARD = {
    (True, False): _per_rows(_backward_call, _rule("n c k,n c k,n k,n k v,n c v,n k v,n c v,k v",
                                                   "n c v,n c k,n c k,n k,k v")),
    (False, False): _per_rows(_backward_call, _rule("n c k,n k,n k v,n c v,n k v,n c v,k v", "n c v,n c k,n k,k v")),
    (True, True): _per_rows(_backward_call, _rule("n c k,n c k,n k,n k v,n c v,n k v,n c v,k v,n c v,n c i,n c v",
                                                  "n c v,n c k,n c k,n k,n c i,k v,n c v")),
}


_PRODUCTS = {  # by (delta rule, dq_dec)
    (delta, q): _per_rows(_products_call, _rule(",".join(["n k v", "n k v", "n c v"] + ["n c v"] * delta
                                                       + ["n c v"] * q),
                                              ",".join(["n c k"] * delta + ["n c k", "n k"] + ["n c k"] * q)))
    for delta in (True, False) for q in (True, False)}

_BACKWARD_STATES = {  # by (delta rule, BWD_FROM_OUTPUT)
    (True, False): _per_rows(_backward_states_call, _rule("n c k,n c k,n k,n k v,n c v,k v", "n c v,n k v,k v")),
    (False, False): _per_rows(_backward_states_call, _rule("n c k,n k,n k v,n c v,k v", "n c v,n k v,k v")),
    (True, True): _per_rows(_backward_states_call,
                            _rule("n c k,n c k,n k,n c k,n c v,n c v,k v", "n c v,n k v,k v")),
    (False, True): _per_rows(_backward_states_call, _rule("n c k,n k,n c k,n c v,n c v,k v", "n c v,n k v,k v")),
}


def _forward(cfg: Config, U0, W, k_end, decay, S0, q_dec=None, P=None, A=None, beta=None):
  """(S_in, U, S_T), U = U0 without the delta rule; with cfg.output (O, S_T)."""
  res = batched_rows(_FORWARD[cfg.delta, cfg.output, cfg.channel], cfg, U0, W, k_end, decay, S0, q_dec, P, A,
                      beta)
  if cfg.delta or cfg.output:
    return res
  S_in, S_T = res
  return S_in, U0, S_T


def _backward(cfg: Config, W, k_end, decay, S_in, U, dS_in, dU, dS_T, U0=None, A=None, beta=None, dO=None):
  """(dU0, dW, dk_end, ddecay, dS0, dA, dbeta): dW None without the delta rule, dA and dbeta None but for
  per-value-channel beta. With dO (the output's cotangent; BWD_PRODUCTS only) the pair (that tuple, dq_dec =
  dO S_in^T [.., N, Cp, Kp] float32)."""
  if cfg.states_bwd and not cfg.channel:
    dU0, dS, dS0 = batched_rows(_BACKWARD_STATES[cfg.delta, cfg.from_output], cfg, W, k_end, decay, dS_in, dU,
                                dS_T)
    if cfg.products:
      dW, dk_end, ddecay, dq_dec = _products(cfg, S_in, U, dU0, dS, dO)
      res = dU0, dW, dk_end, ddecay, dS0, None, None
      return res if dO is None else (res, dq_dec)
    dW, dk_end, ddecay = _from_states(cfg, S_in, U, dU0, dS)
    return dU0, dW, dk_end, ddecay, dS0, None, None
  res = batched_rows(_BACKWARD[cfg.delta, cfg.channel], cfg, W, k_end, decay, S_in, U, dS_in, dU, dS_T, U0, A,
                      beta)
  if cfg.channel:
    dU0, dW, dk_end, ddecay, dA, dS0, dbeta = res
    return dU0, dW, dk_end, ddecay, dS0, dA, dbeta
  if not cfg.delta:
    dU0, dk_end, ddecay, dS0 = res
    res = dU0, None, dk_end, ddecay, dS0
  return res + (None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _state_pass(cfg: Config, U0, W, k_end, decay, S0, A=None, beta=None):
  """(S_in [B, HV, N, Kp, Vp], U [B, HV, N, Cp, Vp], S_T [B, HV, Kp, Vp]) from padded operands (U0, W, k_end
  in cfg.operands, decay and S0 float32); W is None without the delta rule. With cfg.channel (per-value-channel
  beta) U0 is v, W is k_dec, and A [.., Cp, Cp] and beta [.., Cp, Vp] (float32) come too."""
  return _forward(cfg, U0, W, k_end, decay, S0, A=A, beta=beta)


def _state_pass_fwd(cfg, U0, W, k_end, decay, S0, A=None, beta=None):
  S_in, U, S_T = _forward(cfg, U0, W, k_end, decay, S0, A=A, beta=beta)
  # Named, so that a remat policy can keep the kernel's results (`gdn.model`'s "dots_states") rather than run the
  # kernel again in the backward.
  S_in, U = checkpoint_name(S_in, STATES), checkpoint_name(U, WRITES)
  return (S_in, U, S_T), (W, k_end, decay, S_in, U) + ((U0, A, beta) if cfg.channel else ())


def _state_pass_bwd(cfg, res, cts):
  dS_in, dU, dS_T = cts
  return _backward(cfg, *res[:5], dS_in, dU, dS_T, *res[5:])


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def _output(cfg: Config, q_dec, P, S_in, U):
  """O = q_dec S_in + P U per chunk in XLA, at the caller's precision, in O's dtype."""
  return chunk_outputs(q_dec, P, S_in, U, cfg.out_prec).astype(cfg.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output_pass(cfg: Config, U0, W, k_end, decay, S0, q_dec, P, A=None, beta=None):
  """(O [B, HV, N, Cp, Vp] in cfg.out_dtype, S_T [B, HV, Kp, Vp]) from `_state_pass`'s operands and the padded
  q_dec [.., Cp, Kp] and P [.., Cp, Cp]: one forward kernel that never writes S_in or U."""
  return _forward(cfg, U0, W, k_end, decay, S0, q_dec, P, A, beta)


def _output_pass_fwd(cfg, U0, W, k_end, decay, S0, q_dec, P, A=None, beta=None):
  # Differentiated: today's program. The state pass writes S_in and U for the backward kernel, XLA computes O
  # from them, and the backward is the backward kernel after the VJP of that product.
  states = dataclasses.replace(cfg, output=False)
  (S_in, U, S_T), res = _state_pass_fwd(states, U0, W, k_end, decay, S0, A, beta)
  O, out_vjp = jax.vjp(functools.partial(_output, cfg), q_dec, P, S_in, U)
  return (O, S_T), (res, out_vjp, q_dec if cfg.from_output else None)


def _output_pass_bwd(cfg, res, cts):
  res, out_vjp, q_dec = res
  dO, dS_T = cts
  dq_dec, dP, dS_in, dU = out_vjp(dO)  # with from_output dS_in goes unused, and XLA drops it
  if cfg.from_output:  # the backward kernel forms q_dec^T dO itself
    dS_in = (q_dec, dO)
  states = dataclasses.replace(cfg, output=False)
  if cfg.products and cfg.states_bwd and not cfg.channel:  # dq_dec = dO S_in^T in the products kernel instead
    (dU0, dW, dk_end, ddecay, dS0, dA, dbeta), dq = _backward(states, *res[:5], dS_in, dU, dS_T, dO=dO)
    dq_dec = dq.astype(dq_dec.dtype)
  else:
    dU0, dW, dk_end, ddecay, dS0, dA, dbeta = _state_pass_bwd(states, res, (dS_in, dU, dS_T))
  return dU0, dW, dk_end, ddecay, dS0, dq_dec, dP, dA, dbeta


_output_pass.defvjp(_output_pass_fwd, _output_pass_bwd)


def _pad(x, *target, dtype):
  """x in `dtype` (the kernels' operand dtype; float32 for the decays and S0), zero-padded at the end of the
  trailing axes: zero rows of U0, W, k_end, q_dec and P and zero rows/columns of S0 leave the valid part of the
  recurrence and of the output untouched. B and HV stay separate axes, so a batch-sharded caller's sharding
  reaches the kernel ops unchanged."""
  x = _cotangent_in_own_dtype(x) if x.dtype == dtype else x.astype(dtype)
  return jnp.pad(x, [(0, 0)] * (x.ndim - len(target)) + [(0, t - s) for s, t in zip(x.shape[-len(target):], target)])


@jax.custom_vjp
def _cotangent_in_own_dtype(x):
  """x, whose cotangent comes back in x's dtype. The kernels' VJPs return float32 cotangents for their 16-bit
  operands; where an operand was made in float32 and cast (k * exp(decay), the solve's W and U), the cast's
  transpose takes them as they are, but an operand that already is the input's 16-bit array (k itself as k_end
  without a decay gate, v as U0 without beta) would hand a float32 cotangent to a 16-bit value, which autodiff
  cannot add to that value's other cotangents (the naive delta rule's gradient failed so in bfloat16)."""
  return x


def _cotangent_fwd(x):
  return x, jnp.zeros((0,), x.dtype)


def _cotangent_bwd(res, ct):
  return (ct.astype(res.dtype),)


_cotangent_in_own_dtype.defvjp(_cotangent_fwd, _cotangent_bwd)


def _operands(loc: intra_chunk.Local, S0, prec, block_v: int, interpret: Optional[bool], output=None, beta=None):
  """The kernels' Config and padded operands (U0, W or None, k_end, decay, S0, and with `output`, O's dtype, q_dec
  and P; then, for per-value-channel beta (loc.A without loc.W), A and `beta` [B, HV, N, C, V], with k_dec in W's
  place)."""
  channel = loc.W is None and loc.A is not None
  delta = channel or loc.W is not None  # the fused chunk-local kernel returns W without A
  if channel and beta is None:
    raise ValueError("the Pallas state pass needs the chunked beta [B, HV, N, C, V] for per-value-channel beta")
  C, V = loc.U.shape[-2:]
  K = loc.k_end.shape[-1]
  Cp, Kp = _pow2(C), _pow2(K)
  wide = WIDE_KEYS and Kp > 128
  BV = min(_pow2(block_v), _pow2(V), 32 if wide else _pow2(block_v))
  if NARROW_BLOCKS and BV > 32 and math.prod(loc.U.shape[:-3]) * -(-V // BV) < narrow_below():
    BV = 32
  Vp = -(-V // BV) * BV
  operands = "bfloat16" if BF16_OPERANDS and prec == jax.lax.Precision.DEFAULT else "float32"
  op = functools.partial(_pad, dtype=jnp.dtype(operands))
  f32 = functools.partial(_pad, dtype=jnp.float32)
  decay = jnp.broadcast_to(loc.decay, loc.decay.shape[:-1] + (K,))  # per-head decay: the same for every row
  interpret = default_interpret() if interpret is None else interpret
  cfg = Config(prec=kernel_precision(prec, interpret), block_v=BV, interpret=interpret, delta=delta,
               operands=operands, output=output is not None, out_dtype=jnp.dtype(output or jnp.float32).name,
               out_prec=prec if output is not None else None, channel=channel, states_bwd=BWD_STATES and not channel,
               from_output=bool(BWD_FROM_OUTPUT) and BWD_STATES and not channel and output is not None,
               xla_prec=prec if BWD_STATES and not channel else None, wide=wide,
               products=bool(BWD_PRODUCTS) and BWD_STATES and not channel, products_block_k=_pow2(PRODUCTS_BLOCK_K),
               products_warps=PRODUCTS_NUM_WARPS)
  args = (op(loc.U, Cp, Vp), op(loc.k_dec if channel else loc.W, Cp, Kp) if delta else None, op(loc.k_end, Cp, Kp),
          f32(decay, Kp), f32(S0, Kp, Vp))
  if output is not None:
    args += (op(loc.q_dec, Cp, Kp), op(loc.P, Cp, Cp))
  if channel:  # float32: the triangular solve's matrix and weights
    args += (f32(loc.A, Cp, Cp), f32(beta, Cp, Vp))
  return cfg, args


@checks.scoped("state_pass")
def state_pass(loc: intra_chunk.Local, S0, prec, *, beta=None, block_v: int = BLOCK_V,
               interpret: Optional[bool] = None):
  """The chunk-to-chunk recurrence of `chunk.scan_chunks` as a Pallas kernel.

  Args:
    loc: chunk-local quantities [B, HV, N, ...] with `loc.W` set (per-head beta), `loc.A` and `loc.k_dec` without
      `loc.W` (per-value-channel beta), or `loc.A` None (no delta rule).
    S0: the entering state [B, HV, K, V]. prec: matmul precision inside the kernel.
    beta: per-value-channel beta in chunks [B, HV, N, C, V] (`chunk.prepare`'s), read only for that variant.
    block_v: value channels per program (rounded to a power of two >= 16, at most the padded V).
    interpret: run Pallas' interpreter; None: only where the default backend is not a GPU.
  Returns:
    S_T [B, HV, K, V], S_in [B, HV, N, K, V] and U [B, HV, N, C, V], as `chunk.scan_chunks`.
  """
  cfg, args = _operands(loc, S0, prec, block_v, interpret, beta=beta)
  S_in, U, S_T = _state_pass(cfg, *args)
  (C, V), K = loc.U.shape[-2:], loc.k_end.shape[-1]
  return S_T[..., :K, :V], S_in[..., :K, :V], U[..., :C, :V]


@checks.scoped("state_pass_output")
def output_pass(loc: intra_chunk.Local, S0, prec, *, beta=None, out_dtype=jnp.float32, block_v: int = BLOCK_V,
                interpret: Optional[bool] = None):
  """`state_pass` with the output inside the kernel (FUSED_OUTPUT): O = Q_dec S_in + P U per chunk, what
  `chunk.finish` computes from `state_pass`'s results, without S_in or U ever written. Arguments as
  `state_pass`; `loc.q_dec` and `loc.P` are read too; out_dtype: O's dtype in memory.

  Returns:
    O [B, HV, N, C, V] in out_dtype (products accumulated in float32) and S_T [B, HV, K, V] float32.
    Differentiated, the forward is `state_pass`'s kernel and O the XLA product (see `_output_pass_fwd`).
  """
  cfg, args = _operands(loc, S0, prec, block_v, interpret, output=out_dtype, beta=beta)
  O, S_T = _output_pass(cfg, *args)
  (C, V), K = loc.U.shape[-2:], loc.k_end.shape[-1]
  return O[..., :C, :V], S_T[..., :K, :V]


def pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size: int,
           block_v: int = BLOCK_V, interpret: Optional[bool] = None, local_groups: int = 1, g_lower_bound=None):
  """`method="pallas"`: `chunk` with its sequential chunk scan replaced by the Pallas kernels, and with
  `FUSED_LOCAL` its chunk-local work by `pallas_local`'s kernel (per-head decay and beta); local_groups and
  g_lower_bound as `chunk`'s (a bound takes a per-key-channel decay's stage from the kernel to XLA's bounded
  factorisation). Every variant: with per-value-channel beta the state-pass kernel solves each chunk's write vectors
  per value channel (`_channel_solve`)."""
  chunk_size = min(chunk_size, dims.T)

  def run(q, k, v, g, beta, initial_state, segment_ids):
    interp = default_interpret() if interpret is None else interpret
    switch = lambda flag: (not interp) if flag is None else flag  # None: where the kernels compile
    # WIDE_KEYS: the fused chunk-local kernel at eight warps too (offline for sm_90 at K = 256 it spills 104
    # bytes at four, none at eight; docs/benchmarks.md).
    warps = 8 if WIDE_KEYS and _pow2(dims.K) > 128 else None
    local = (functools.partial(pallas_local.local, interpret=interpret, num_warps=warps) if switch(FUSED_LOCAL)
             else intra_chunk.local)
    loc, _, bc, _, cdt, prec = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                       chunk_size=chunk_size, local=local, local_groups=local_groups,
                                       g_lower_bound=g_lower_bound)
    S0 = initial(initial_state, dims, cdt)
    bc = bc if dims.beta_kind == "channel" else None
    if switch(FUSED_OUTPUT):
      out_dtype = v.dtype if v.dtype.itemsize < 4 else jnp.float32  # 16-bit: the op's output dtype
      O, S_T = output_pass(loc, S0, prec, beta=bc, out_dtype=out_dtype, block_v=block_v, interpret=interpret)
      return unchunk(O.astype(v.dtype), dims, chunk_size), S_T.astype(cdt)  # O: out_dtype, v's for 16 bits
    S_T, S_in, U = state_pass(loc, S0, prec, beta=bc, block_v=block_v, interpret=interpret)
    return finish(loc, S_in, U, prec, dims, chunk_size, out_dtype=v.dtype), S_T.astype(cdt)

  return isolate_segments(run)(q, k, v, g, beta, initial_state, segment_ids)
