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

The kernels use the Pallas Triton lowering on GPU (ref indexing, `lax.fori_loop`, `lax.dot_general`: nothing
backend-specific in the kernel bodies) and Pallas' interpreter everywhere else; docs/ops.md says why.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from gdn.ops import checks, intra_chunk
from gdn.ops.chunk import finish, initial, prepare

BLOCK_V = 64  # value channels per program: a [128, 64] float32 state is 64 registers a thread at 4 warps


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one state pass (hashable: a `nondiff_argnums` of the custom VJP)."""
  prec: jax.lax.Precision | jax.lax.DotAlgorithmPreset  # see `kernel_precision`
  block_v: int
  interpret: bool
  delta: bool  # False without the delta rule (no W): then U = U0 and the kernels skip its matmul


def _pow2(n: int, least: int = 16) -> int:
  """Triton needs power-of-two block shapes, and at least 16 along every dot dimension."""
  return max(least, 1 << max(0, n - 1).bit_length())


def _dot(a, b, ta: bool, tb: bool, prec):
  """a @ b with a or b read transposed, accumulated in float32 (2-D operands only, as Triton wants)."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _forward_kernel(*refs, cfg: Config, N: int):
  if cfg.delta:
    u0_ref, w_ref, kend_ref, decay_ref, s0_ref, s_in_ref, u_ref, s_t_ref = refs
  else:
    u0_ref, kend_ref, decay_ref, s0_ref, s_in_ref, s_t_ref = refs

  def body(n, S):
    s_in_ref[n] = S
    U = u0_ref[n].astype(jnp.float32)
    if cfg.delta:
      U = U - _dot(w_ref[n], S, False, False, cfg.prec)  # [Cp, BV]
      u_ref[n] = U.astype(u_ref.dtype)
    kS = _dot(kend_ref[n], U, True, False, cfg.prec)  # k_end^T U: [Kp, BV]
    return decay_ref[n].astype(jnp.float32)[:, None] * S + kS

  S = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(jnp.float32))
  s_t_ref[...] = S.astype(s_t_ref.dtype)


def _backward_kernel(*refs, cfg: Config, N: int):
  if cfg.delta:
    (w_ref, kend_ref, decay_ref, s_in_ref, u_ref, ds_in_ref, du_ref, ds_t_ref,
     du0_ref, dw_ref, dkend_ref, ddecay_ref, ds0_ref) = refs
  else:
    (kend_ref, decay_ref, s_in_ref, u_ref, ds_in_ref, du_ref, ds_t_ref,
     du0_ref, dkend_ref, ddecay_ref, ds0_ref) = refs

  def body(i, dS):  # dS: the cotangent of the state leaving chunk n
    n = N - 1 - i
    S = s_in_ref[n].astype(jnp.float32)
    dU = du_ref[n].astype(jnp.float32) + _dot(kend_ref[n], dS, False, False, cfg.prec)  # [Cp, BV]
    du0_ref[n] = dU.astype(du0_ref.dtype)
    dkend_ref[n] = _dot(u_ref[n], dS, False, True, cfg.prec).astype(dkend_ref.dtype)  # U dS^T: [Cp, Kp]
    ddecay_ref[n] = jnp.sum(S * dS, axis=1).astype(ddecay_ref.dtype)
    dS_prev = decay_ref[n].astype(jnp.float32)[:, None] * dS + ds_in_ref[n].astype(jnp.float32)
    if cfg.delta:
      dw_ref[n] = (-_dot(dU, S, False, True, cfg.prec)).astype(dw_ref.dtype)  # -dU S^T: [Cp, Kp]
      dS_prev = dS_prev - _dot(w_ref[n], dU, True, False, cfg.prec)  # W^T dU
    return dS_prev

  dS = jax.lax.fori_loop(0, N, body, ds_t_ref[...].astype(jnp.float32))
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


def _forward(cfg: Config, U0, W, k_end, decay, S0):
  L, N, Cp, Vp = U0.shape
  Kp, BV = k_end.shape[-1], cfg.block_v
  per_v, per_k, dec, state, _, _ = _specs(L, N, Cp, Kp, BV)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  ins = [U0] + ([W] if cfg.delta else []) + [k_end, decay, S0]
  in_specs = [per_v(Cp)] + ([per_k] if cfg.delta else []) + [per_k, dec, state]
  outs = [f32(L, N, Kp, Vp)] + ([f32(L, N, Cp, Vp)] if cfg.delta else []) + [f32(L, Kp, Vp)]
  out_specs = [per_v(Kp)] + ([per_v(Cp)] if cfg.delta else []) + [state]
  # Two stages let Triton prefetch chunk n + 1's W, k_end and U0 while chunk n computes: about 200 KB of
  # shared memory at K = 128, C = BV = 64 (Triton 3.9, sm_90), under the H200's 227 KB; one stage beyond.
  stages = 2 if Cp * Kp <= 64 * 128 and BV <= 64 else 1
  res = _call(functools.partial(_forward_kernel, cfg=cfg, N=N), cfg, (L, Vp // BV), ins, in_specs, outs,
              out_specs, "gdn_chunk_states_fwd", 4, stages)
  if cfg.delta:
    return tuple(res)
  S_in, S_T = res
  return S_in, U0, S_T


def _backward(cfg: Config, W, k_end, decay, S_in, U, dS_in, dU, dS_T):
  L, N, Cp, Vp = U.shape
  Kp, BV = k_end.shape[-1], cfg.block_v
  NV = Vp // BV
  per_v, per_k, dec, state, part_k, part_decay = _specs(L, N, Cp, Kp, BV)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  ins = ([W] if cfg.delta else []) + [k_end, decay, S_in, U, dS_in, dU, dS_T]
  in_specs = ([per_k] if cfg.delta else []) + [per_k, dec, per_v(Kp), per_v(Cp), per_v(Kp), per_v(Cp), state]
  outs = ([f32(L, N, Cp, Vp)] + ([f32(L, NV, N, Cp, Kp)] if cfg.delta else [])
          + [f32(L, NV, N, Cp, Kp), f32(L, NV, N, Kp), f32(L, Kp, Vp)])
  out_specs = [per_v(Cp)] + ([part_k] if cfg.delta else []) + [part_k, part_decay, state]
  # One stage: two would take about 256 KB of shared memory at K = 128, C = BV = 64, over the H200's 227 KB.
  # Eight warps: the state and its cotangent both live in registers; at four the compiled kernel spilled.
  res = _call(functools.partial(_backward_kernel, cfg=cfg, N=N), cfg, (L, NV), ins, in_specs, outs, out_specs,
              "gdn_chunk_states_bwd", 8, 1)
  if cfg.delta:
    dU0, dW, dk_end, ddecay, dS0 = res
    dW = dW.sum(1)
  else:
    dU0, dk_end, ddecay, dS0 = res
    dW = None
  return dU0, dW, dk_end.sum(1), ddecay.sum(1), dS0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _state_pass(cfg: Config, U0, W, k_end, decay, S0):
  """(S_in [L, N, Kp, Vp], U [L, N, Cp, Vp], S_T [L, Kp, Vp]) from padded float32 operands; W is None
  without the delta rule."""
  return _forward(cfg, U0, W, k_end, decay, S0)


def _state_pass_fwd(cfg, U0, W, k_end, decay, S0):
  S_in, U, S_T = _forward(cfg, U0, W, k_end, decay, S0)
  return (S_in, U, S_T), (W, k_end, decay, S_in, U)


def _state_pass_bwd(cfg, res, cts):
  W, k_end, decay, S_in, U = res
  dS_in, dU, dS_T = cts
  return _backward(cfg, W, k_end, decay, S_in, U, dS_in, dU, dS_T)


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def default_interpret() -> bool:
  """Compiled Triton kernels on a GPU backend; Pallas' interpreter elsewhere (CPU CI runs the same kernels)."""
  return jax.default_backend() != "gpu"


def kernel_precision(prec, interpret: bool):
  """The dot precision inside the kernels. Compiled, a float32 caller's HIGHEST becomes 3xTF32 (three TF32
  tensor-core products, float32 accumulation, about float32 accuracy): Triton lowers HIGHEST to IEEE float32
  dots without tensor cores, which spill heavily at K = 128. DEFAULT (bfloat16 callers) is one TF32 product,
  as XLA does it. The interpreter keeps `prec`: XLA:CPU has no TF32 algorithms."""
  if not interpret and prec == jax.lax.Precision.HIGHEST:
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return prec


def state_pass(loc: intra_chunk.Local, S0, prec, *, block_v: int = BLOCK_V, interpret: Optional[bool] = None):
  """The chunk-to-chunk recurrence of `chunk.scan_chunks` (per-head or no beta) as a Pallas kernel.

  Args:
    loc: chunk-local quantities [B, HV, N, ...] with `loc.W` set, or `loc.A` None (no delta rule).
    S0: the entering state [B, HV, K, V]. prec: matmul precision inside the kernel.
    block_v: value channels per program (rounded to a power of two >= 16, at most the padded V).
    interpret: run Pallas' interpreter; None: only where the default backend is not a GPU.
  Returns:
    S_T [B, HV, K, V], S_in [B, HV, N, K, V] and U [B, HV, N, C, V], as `chunk.scan_chunks`.
  """
  delta = loc.A is not None
  if delta and loc.W is None:
    raise ValueError("the Pallas state pass needs loc.W (per-head beta); per-value-channel beta has none")
  B, HV, N, C, V = loc.U.shape
  K = loc.k_end.shape[-1]
  L = B * HV
  Cp, Kp = _pow2(C), _pow2(K)
  BV = min(_pow2(block_v), _pow2(V))
  Vp = -(-V // BV) * BV
  cdt = jnp.float32

  def pad(x, *target):
    """[B, HV, N, ...] -> [L, N, ...] in float32, zero-padded at the end of the trailing axes: zero rows of
    U0, W and k_end and zero rows/columns of S0 leave the valid part of the recurrence untouched."""
    x = x.astype(cdt).reshape((L,) + x.shape[2:])
    return jnp.pad(x, [(0, 0)] * (x.ndim - len(target)) + [(0, t - s) for s, t in zip(x.shape[-len(target):],
                                                                                        target)])

  decay = jnp.broadcast_to(loc.decay, loc.decay.shape[:-1] + (K,))  # per-head decay: the same for every row
  interpret = default_interpret() if interpret is None else interpret
  cfg = Config(prec=kernel_precision(prec, interpret), block_v=BV, interpret=interpret, delta=delta)
  S_in, U, S_T = _state_pass(cfg, pad(loc.U, Cp, Vp), pad(loc.W, Cp, Kp) if delta else None,
                             pad(loc.k_end, Cp, Kp), pad(decay, Kp), pad(S0, Kp, Vp))
  S_in = S_in[:, :, :K, :V].reshape(B, HV, N, K, V)
  U = U[:, :, :C, :V].reshape(B, HV, N, C, V)
  S_T = S_T[:, :K, :V].reshape(B, HV, K, V)
  return S_T, S_in, U


def pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size: int,
           block_v: int = BLOCK_V, interpret: Optional[bool] = None):
  """`method="pallas"`: `chunk` with its sequential chunk scan replaced by the Pallas kernels. Declines
  per-value-channel beta (its write vectors need a solve per value channel inside the scan)."""
  if dims.beta_kind == "channel":
    raise ValueError("method='pallas' does not support per-value-channel beta ([B, T, HV, V]); "
                     "use method='chunk' or 'recurrent', or a per-head beta [B, T, HV]")
  loc, _, _, _, cdt, prec = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                    chunk_size=chunk_size)
  S_T, S_in, U = state_pass(loc, initial(initial_state, dims, cdt), prec, block_v=block_v, interpret=interpret)
  return finish(loc, S_in, U, prec, dims, chunk_size), S_T.astype(cdt)
