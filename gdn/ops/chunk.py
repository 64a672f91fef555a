"""Chunkwise gated delta rule: chunk-local WY/UT work in parallel, then `lax.scan` over chunks.

Shapes: B batch, T time, HV value heads, N chunks, C chunk size, K key dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdn.ops import checks, intra_chunk
from gdn.ops.recurrent import expand_heads, reset_flags

STATES = "gdn_chunk_states"  # checkpoint name of the per-chunk entering states: all the backward keeps
WRITES = "gdn_chunk_writes"  # checkpoint name of the per-chunk write vectors U, the state pass's other result
# 16-bit callers get 16-bit chunk-local operands (q, k, v in, and q_dec, k_dec, k_end, P, W, U out; products
# accumulate in float32, decays, gates, the triangular inverse and the state stay float32). False: float32 throughout.
BF16_LOCAL = True
# The backward of the chunk scan and the output as one explicit reverse scan over the chunks (`_output_pass`), for
# per-head or no beta: keeps S_in and U once (JAX's autodiff of the scan keeps them twice, as its outputs and as
# its residuals), never stacks their float32 cotangents, and returns 16-bit cotangents for the 16-bit operands.
# False: JAX's autodiff of `scan_chunks` and `finish` (today).
OUTPUT_VJP = False
# The gradients of the per-position scalars (per-head g and beta, [B, T, HV]) leave the chunk layout [B, HV, N, C]
# through an optimization barrier: True, so XLA does not fuse their transpose back to [B, T, HV] into the reductions
# that form them. On the H200 beta's gradient, sum_v dU v read through that transpose, was one fusion of 0.54 ms at
# (2, 16384, 16, 128) (bfloat16, pallas: 8% of the forward+backward; its 128 MiB of reads take about 0.03 ms at the
# card's bandwidth), emitted as a transpose with the reduction inside it. A `jax.custom_vjp` around the layout change:
# the op then takes no forward-mode derivative (jax.jvp) through g and beta. Off: on the H200 it changed
# forward+backward by -0.1%, +1.0%, -3.8% at three shapes (results/benchmarks/h200_2026-12-02/scalar_grad_barrier.txt).
SCALAR_GRAD_BARRIER = False
# The same for the [B, T, HV, K] inputs (q, k, v, a per-key-channel g, a per-value-channel beta): their cotangents
# leave the chunk layout through an optimization barrier. Traced at (4, 2048, 16, 128) on an H100 (2026-12-06,
# KDA, results/benchmarks/h100_2026-12-06/kda_diag_profile.txt), the backward's two largest XLA kernels are
# transpose fusions (`loop_add_multiply_transpose_fusion` 0.45 ms, `loop_transpose_fusion` 0.38 ms), and in the
# chunk-local stage the only transposes of that size in the backward's jaxpr are these cotangents' layout changes
# back to [B, T, HV, K] (dq's is a sum of two parts times the scale: an add and a multiply). Timed on the card:
# 1.03x and 0.99x forward+backward at (4, 2048, 16, 128) and (2, 16384, 16, 128), so off. Its HLO
# (h100_2026-12-06/kda_tuned_4_2048_16_128.hlo.txt.gz) shows the first fusion near the bandwidth for its 23
# operands (the dyadic levels' float32 partial gradients), not a slow transpose (docs/benchmarks.md).
TENSOR_GRAD_BARRIER = False


def compute_dtype(dtype):
  """float32 whatever the input dtype (float64 inputs stay float64, which the oracle tests use)."""
  return jnp.promote_types(jnp.float32, dtype)


def precision_for(dtype):
  """Full-precision matmuls for float32 inputs; a caller who passes bfloat16 accepts its matmul precision."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else jax.lax.Precision.DEFAULT


def operand_dtype(dtype):
  """The chunk-local operands' dtype for inputs of `dtype` (see BF16_LOCAL)."""
  if BF16_LOCAL and jnp.dtype(dtype).itemsize < 4:
    return jnp.dtype(dtype)
  return compute_dtype(dtype)


def _to_chunks(x, N, C, T):
  """[B, T, HV, ...] -> [B, HV, N, C, ...], zero-padded at the end (zeros leave the state unchanged)."""
  if x is None:
    return None
  pad = N * C - T
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  barrier = SCALAR_GRAD_BARRIER if x.ndim == 3 else TENSOR_GRAD_BARRIER
  x = _heads_first_barrier(x) if barrier else jnp.moveaxis(x, 2, 1)
  return x.reshape(x.shape[:2] + (N, C) + x.shape[3:])


@jax.custom_vjp
def _heads_first_barrier(x):
  """[B, T, HV, ...] -> [B, HV, T, ...], whose VJP puts an optimization barrier on the cotangent before the
  transpose back (SCALAR_GRAD_BARRIER, TENSOR_GRAD_BARRIER)."""
  return jnp.moveaxis(x, 2, 1)


def _heads_first_fwd(x):
  return jnp.moveaxis(x, 2, 1), None


def _heads_first_bwd(_, ct):
  return (jnp.moveaxis(jax.lax.optimization_barrier(ct), 1, 2),)


_heads_first_barrier.defvjp(_heads_first_fwd, _heads_first_bwd)


def _segment_masks(segment_ids, B, T, N, C):
  """Masks for packed sequences, or None. Padding continues the last segment."""
  if segment_ids is None:
    return None
  reset = reset_flags(segment_ids, B, T)
  reset = jnp.pad(reset, [(0, 0), (0, N * C - T)]).reshape(B, 1, N, C)
  seg = jnp.cumsum(reset.reshape(B, 1, N * C), axis=-1).reshape(B, 1, N, C)
  entering = seg[..., :1] - reset[..., :1]  # the segment of the position before the chunk
  same = seg[..., :, None] == seg[..., None, :]
  carries = seg == entering
  reaches_end = seg == seg[..., -1:]
  unbroken = seg[..., -1:] == entering
  return same, carries, reaches_end, unbroken


def isolate_segments(run):
  """Wraps a chunked method's `run(q, k, v, g, beta, initial_state, segment_ids) -> (o, S_T)` so that, with
  segment_ids, a non-finite input reaches exactly the outputs that it reaches in the recurrence, and nothing
  of another packed sequence, forward or backward.

  A chunk mixes its positions in matmuls and solves whose weights across a reset are exact zeros, but
  0 * inf = NaN: a NaN in one sequence would reach every sequence sharing its chunks (and, through the
  cotangents of masked products, their gradients). So the chunk form runs on inputs whose non-finite entries
  are zeroed (g = -inf, total forgetting, is kept), and the outputs the recurrence would have made non-finite
  are set to NaN after: a non-finite q_t reaches o_t; a non-finite k, v, g or beta at t reaches o from t to the
  end of its sequence, and the final state if that sequence is the last; a non-finite initial state reaches
  the first sequence. The gradients of a loss on the other sequences' outputs are exact.
  """

  def isolated(q, k, v, g, beta, initial_state, segment_ids):
    if segment_ids is None:
      return run(q, k, v, g, beta, initial_state, segment_ids)
    HV = v.shape[2]
    ok = lambda x: None if x is None else jnp.isfinite(x)
    ok_g = None if g is None else ~(jnp.isnan(g) | (g == jnp.inf))
    clean = lambda x, fine: None if x is None else jnp.where(fine, x, jnp.zeros((), x.dtype))
    # [B, T, HV]: is any entry of the position's input non-finite (q/k heads repeated to value heads)
    bad = lambda fine: None if fine is None else expand_heads(~jnp.all(fine.reshape(fine.shape[:3] + (-1,)), -1),
                                                              HV, 2)
    oks = dict(q=ok(q), k=ok(k), v=ok(v), g=ok_g, beta=ok(beta))
    writes = [b for b in map(bad, (oks["k"], oks["v"], oks["g"], oks["beta"])) if b is not None]
    bad_t = functools.reduce(jnp.logical_or, writes).astype(jnp.int32)  # [B, T, HV]
    reset = reset_flags(segment_ids, *segment_ids.shape)[..., None]
    upto = jnp.cumsum(bad_t, axis=1)
    before_segment = jax.lax.cummax(jnp.where(reset, upto - bad_t, 0), axis=1)
    reached = upto > before_segment  # a bad write at or before t in t's sequence
    S0 = initial_state
    if S0 is not None:
      ok_S0 = jnp.isfinite(S0)
      first = (jnp.cumsum(reset, axis=1) == 0)  # [B, T, 1]
      reached = reached | (first & ~jnp.all(ok_S0, axis=(2, 3))[:, None, :])
      S0 = clean(S0, ok_S0)
    o, S_T = run(clean(q, oks["q"]), clean(k, oks["k"]), clean(v, oks["v"]), clean(g, oks["g"]),
                 clean(beta, oks["beta"]), S0, segment_ids)
    nan = lambda x, where: jnp.where(where, jnp.asarray(jnp.nan, x.dtype), x)
    return nan(o, (reached | bad(oks["q"]))[..., None]), nan(S_T, reached[:, -1, :, None, None])

  return isolated


@checks.scoped("chunk_local")
def prepare(q, k, v, g, beta, *, scale, segment_ids, dims: checks.Dims, chunk_size: int, solver="blocked",
            local=intra_chunk.local, local_groups: int = 1, g_lower_bound=None):
  """Pad, chunk and compute the chunk-local quantities with `local` (`intra_chunk.local` or a function of its
  signature, such as `pallas_local.local`), its backward over `local_groups` groups of chunks
  (`intra_chunk.grouped`). g_lower_bound (the op's, g already clamped to it): a per-key-channel decay's stage is
  `intra_chunk.local` with its bounded factorisation, whatever `local` was. Returns (Local, v_chunks,
  beta_chunks, N, cdt, prec)."""
  B, T, HV = dims.B, dims.T, dims.HV
  C = chunk_size
  N = -(-T // C)
  cdt = compute_dtype(v.dtype)
  prec = precision_for(jnp.result_type(q, k, v))
  odt = operand_dtype(jnp.result_type(q, k, v))
  cast = lambda x: None if x is None else x.astype(cdt)
  qc = _to_chunks(expand_heads((cast(q) * scale).astype(odt), HV, 2), N, C, T)
  kc = _to_chunks(expand_heads(k.astype(odt), HV, 2), N, C, T)
  vc = _to_chunks(v.astype(odt), N, C, T)
  gc = _to_chunks(cast(g), N, C, T)
  bc = _to_chunks(cast(beta), N, C, T)
  masks = _segment_masks(segment_ids, B, T, N, C)
  if g_lower_bound is not None and g is not None and g.ndim == 4:
    local = functools.partial(intra_chunk.local, g_lower_bound=g_lower_bound)
  # One flat batch axis for the chunk-local work: XLA:CPU has crashed compiling the backward of batched
  # matmuls with three leading batch axes.
  lead = (B, HV, N)
  flat = lambda x: None if x is None else jnp.broadcast_to(x, lead + x.shape[3:]).reshape((-1,) + x.shape[3:])
  masks = None if masks is None else tuple(map(flat, masks))
  loc = intra_chunk.grouped(local, local_groups)(flat(qc), flat(kc), flat(vc), flat(gc), flat(bc), masks,
                                                 beta_kind=dims.beta_kind, prec=prec, solver=solver)
  loc = jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), loc)
  return loc, vc, bc, N, cdt, prec


def write_vectors(loc: intra_chunk.Local, S_in, beta_c, prec):
  """U for every chunk given its entering state S_in [B, HV, N, K, V]."""
  if loc.W is not None:  # per-head beta (A may be None: `pallas_local`, `intra_chunk.grouped` leave it out)
    return loc.U - intra_chunk.mm("...ck,...kv->...cv", loc.W, S_in, precision=prec)
  if loc.A is None:
    return loc.U
  return _solve_channel_beta(loc.A, beta_c, loc.U, loc.k_dec, S_in, prec)


def _solve_channel_beta(A, beta_c, v, k_dec, S_in, prec):
  """Per-value-channel beta: one triangular system (I + Diag(beta_j) A) per value channel j."""
  rhs = beta_c * (v - intra_chunk.mm("...ck,...kv->...cv", k_dec, S_in, precision=prec))  # [.., C, V]
  L = jnp.moveaxis(beta_c, -1, -2)[..., :, :, None] * A[..., None, :, :]  # [.., V, C, C]
  x = intra_chunk.solve_unit_lower(L, jnp.moveaxis(rhs, -1, -2)[..., None])  # [.., V, C, 1]
  return jnp.moveaxis(x[..., 0], -2, -1)


def next_state(loc_n, S, U, prec):
  """S_C = Diag(e^{gamma_C}) S + K_end^T U for one chunk (arrays without the N axis)."""
  return loc_n.decay[..., None] * S + intra_chunk.mm("...ck,...cv->...kv", loc_n.k_end, U, precision=prec)


def _n_first(x):
  """[B, HV, N, ...] -> [N, B, HV, ...] (None stays None): the layout a `lax.scan` over chunks walks."""
  return None if x is None else jnp.moveaxis(x, 2, 0)


@checks.scoped("state_pass")
def scan_chunks(loc: intra_chunk.Local, beta_c, S0, prec, collect: bool = True):
  """The chunk-to-chunk recurrence as a sequential `lax.scan` from S0 [B, HV, K, V'] (V' may differ from V
  when the caller scans a stacked state). Returns the end state and, with `collect`, the entering states
  S_in [B, HV, N, K, V'] and write vectors U [B, HV, N, C, V'] (else None, None)."""
  def body(S, xs):
    loc_n, b_n = xs
    U = write_vectors(loc_n, S, b_n, prec)
    return next_state(loc_n, S, U, prec), ((S, U) if collect else None)

  S_T, ys = jax.lax.scan(body, S0, (jax.tree.map(_n_first, loc), _n_first(beta_c)))
  if not collect:
    return S_T, None, None
  S_in, U = ys
  return S_T, jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(U, 0, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output_pass(prec, q_dec, P, U0, W, k_end, decay, S0):
  """O = Q_dec S_in + P U per chunk [B, HV, N, C, V] (float32) and S_T, from `scan_chunks` (per-head or no beta:
  W None) and `chunk_outputs`; its backward is the explicit reverse scan of `_output_pass_bwd`."""
  return _output_pass_fwd(prec, q_dec, P, U0, W, k_end, decay, S0)[0]


def _output_pass_fwd(prec, q_dec, P, U0, W, k_end, decay, S0):
  loc = intra_chunk.Local(q_dec=None, k_dec=None, k_end=k_end, decay=decay, P=None, A=None, W=W, U=U0)
  S_T, S_in, U = scan_chunks(loc, None, S0, prec)
  res = (q_dec, P, W, k_end, decay, S_in, U, jnp.zeros((0,), U0.dtype))  # U0's dtype, in an array
  return (chunk_outputs(q_dec, P, S_in, U, prec), S_T), res


def _output_pass_bwd(prec, res, cts):
  """The VJP of the output and the chunk recurrence, chunk by chunk in reverse with the state's cotangent dS as
  the carry (the output's VJP, then the Pallas backward kernel's arithmetic, `pallas_chunk._backward_kernel`):
  per chunk n, from dO = dO[n] and dS leaving the chunk,
    dq_dec = dO S_in^T;  dP = dO U^T;  dU = P^T dO + k_end dS;  dU0 = dU;  dk_end = U dS^T;
    ddecay = rowsum(S_in * dS);  dW = -dU S_in^T;  dS <- Diag(decay) dS + q_dec^T dO - W^T dU.
  Each cotangent leaves the loop in its primal's dtype; the cotangents of S_in and U are never stacked."""
  q_dec, P, W, k_end, decay, S_in, U, u0 = res
  dO, dS_T = cts
  dot = lambda spec, *xs: intra_chunk.mm(spec, *xs, precision=prec)

  def body(dS, xs):
    q_n, P_n, W_n, k_n, d_n, S_n, U_n, dO_n = xs
    dq = dot("...cv,...kv->...ck", dO_n, S_n)
    dP = dot("...tv,...iv->...ti", dO_n, U_n)
    dU_n = dot("...ti,...tv->...iv", P_n, dO_n) + dot("...ck,...kv->...cv", k_n, dS)
    dk = dot("...cv,...kv->...ck", U_n, dS)
    dd = jnp.sum(S_n * dS, axis=-1)
    dd = jnp.sum(dd, axis=-1, keepdims=True) if d_n.shape[-1] == 1 else dd  # per-head decay: one factor
    dS_prev = d_n[..., None] * dS + dot("...ck,...cv->...kv", q_n, dO_n)
    dW = None
    if W_n is not None:
      dW = (-dot("...cv,...kv->...ck", dU_n, S_n)).astype(W_n.dtype)
      dS_prev = dS_prev - dot("...ck,...cv->...kv", W_n, dU_n)
    cast = lambda x, like: x.astype(like.dtype)
    return dS_prev, (cast(dq, q_n), cast(dP, P_n), dU_n.astype(u0.dtype), dW, cast(dk, k_n), cast(dd, d_n))

  xs = tuple(map(_n_first, (q_dec, P, W, k_end, decay, S_in, U, dO)))
  dS0, ys = jax.lax.scan(body, dS_T, xs, reverse=True)
  dq_dec, dP, dU0, dW, dk_end, ddecay = (None if y is None else jnp.moveaxis(y, 0, 2) for y in ys)
  return dq_dec, dP, dU0, dW, dk_end, ddecay, dS0


_output_pass.defvjp(_output_pass_fwd, _output_pass_bwd)


def chunk_outputs(q_dec, P, S_in, U, prec):
  """Q_dec S_in + P U per chunk [.., C, V], accumulated in float32 (float64 for float64 operands)."""
  return (intra_chunk.mm("...ck,...kv->...cv", q_dec, S_in, precision=prec)
          + intra_chunk.mm("...ti,...iv->...tv", P, U, precision=prec))


def unchunk(o, dims: checks.Dims, C: int):
  """[B, HV, N, C, V] -> [B, T, HV, V], the padding after T dropped."""
  B, HV, N = o.shape[:3]
  o = jnp.moveaxis(o.reshape(B, HV, N * C, dims.V), 1, 2)
  return o[:, :dims.T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def outputs_in(prec, out_dtype, q_dec, P, S_in, U):
  """`chunk_outputs` rounded to `out_dtype` (the op's output dtype) where it is made, with its own VJP: from the
  cotangent in `out_dtype` as it comes, dq_dec = dO S_in^T, dS_in = Q_dec^T dO, dP = dO U^T and dU = P^T dO, each
  accumulated in float32 and formed in the layout it is returned in. (Autodiff of the float32 product and the
  cast widens dO to float32 and forms dS_in and dP transposed, then transposes them.)"""
  return chunk_outputs(q_dec, P, S_in, U, prec).astype(out_dtype)


def _outputs_in_fwd(prec, out_dtype, q_dec, P, S_in, U):
  return outputs_in(prec, out_dtype, q_dec, P, S_in, U), (q_dec, P, S_in, U)


def _outputs_in_bwd(prec, out_dtype, res, dO):
  q_dec, P, S_in, U = res
  mm = lambda spec, a, b, like: intra_chunk.mm(spec, a, b, precision=prec).astype(like.dtype)
  return (mm("...cv,...kv->...ck", dO, S_in, q_dec), mm("...cv,...iv->...ci", dO, U, P),
          mm("...ck,...cv->...kv", q_dec, dO, S_in), mm("...ci,...cv->...iv", P, dO, U))


outputs_in.defvjp(_outputs_in_fwd, _outputs_in_bwd)


@checks.scoped("output")
def finish(loc, S_in, U, prec, dims: checks.Dims, C: int, out_dtype=None):
  """o = Q_dec S_in + P U, back to [B, T, HV, V]: float32 (float64 for float64 operands), or with `out_dtype`
  rounded to it before the relayout (`outputs_in`: the same values, half the bytes moved for 16-bit outputs)."""
  if out_dtype is None:
    return unchunk(chunk_outputs(loc.q_dec, loc.P, S_in, U, prec), dims, C)
  return unchunk(outputs_in(prec, jnp.dtype(out_dtype), loc.q_dec, loc.P, S_in, U), dims, C)


def initial(initial_state, dims, cdt):
  if initial_state is None:
    return jnp.zeros((dims.B, dims.HV, dims.K, dims.V), cdt)
  return initial_state.astype(cdt)


def chunk(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size: int,
          remat: bool = False, solver: str = "blocked", local_groups: int = 1, g_lower_bound=None):
  """`method="chunk"`. With `remat`, the backward keeps only the chunk-entering states and recomputes the
  chunk-local work; off by default because it did not lower XLA's peak memory (docs/benchmarks.md).
  local_groups: the chunk-local stage's backward over that many groups of chunks (`intra_chunk.grouped`).
  g_lower_bound: as `prepare`'s."""

  chunk_size = min(chunk_size, dims.T)  # one chunk of T, not a chunk padded past the sequence

  def run(q, k, v, g, beta, initial_state, segment_ids):
    loc, vc, bc, N, cdt, prec = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                        chunk_size=chunk_size, solver=solver, local_groups=local_groups,
                                        g_lower_bound=g_lower_bound)
    S0 = initial(initial_state, dims, cdt)
    if OUTPUT_VJP and (loc.W is not None or loc.A is None):  # not per-value-channel beta
      O, S_T = _output_pass(prec, loc.q_dec, loc.P, loc.U, loc.W, loc.k_end, loc.decay, S0)
      return unchunk(O, dims, chunk_size), S_T
    S_T, S_in, U = scan_chunks(loc, bc, S0, prec)
    S_in, U = checkpoint_name(S_in, STATES), checkpoint_name(U, WRITES)
    return finish(loc, S_in, U, prec, dims, chunk_size, out_dtype=v.dtype), S_T

  if remat:
    run = jax.checkpoint(run, policy=jax.checkpoint_policies.save_only_these_names(STATES))
  return isolate_segments(run)(q, k, v, g, beta, initial_state, segment_ids)
