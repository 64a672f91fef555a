"""The chunk pipeline of the gated delta rule as three public stages: prepare, state pass, finish.

Every chunkwise method ("chunk", "associative", "pallas", and the context-parallel form) is these stages with a
different state pass; the stages are public so that kernels, benchmarks and new parallel schemes compose them
without reaching into a method's private names:

  p = prepare(q, k, v, g, beta, scale=..., segment_ids=..., chunk_size=64)   # chunk-local work, parallel over chunks
  S_T, S_in, U = state_pass(p, S0, method="scan" | "associative" | "pallas") # chunk-to-chunk recurrence
  o = finish(p, S_in, U)                                                     # o = Q_dec S_in + P U

`finish(p, *state_pass(p, S0)[1:])` equals `gated_delta_rule(q, k, v, g, beta, initial_state=S0)` (before the cast
to v's dtype). All arrays are in the compute dtype (float32, or float64 for float64 inputs).

Shapes: B batch, T time, H q/k heads, HV value heads, N chunks, C chunk size, K key dim, V value dim.
  Prepared.local: `intra_chunk.Local`, fields [B, HV, N, ...]: q_dec, k_end [.., C, K]; decay [.., 1 or K];
    P [.., C, C] (intra-chunk attention); U [.., C, V] (write vectors before the state term); W [.., C, K] (per-head
    beta) or A (per-channel beta) or neither (no delta rule).
  S0, S_T [B, HV, K, V]; S_in [B, HV, N, K, V] (the state entering each chunk); U [B, HV, N, C, V].
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from gdn.ops import associative, checks, chunk, intra_chunk, pallas_chunk

STATE_PASSES = ("scan", "associative", "pallas")


class Prepared(NamedTuple):
  """What `prepare` computed: the chunk-local quantities and what the later stages need to know."""
  local: intra_chunk.Local
  beta: Optional[jax.Array]  # beta in chunks [B, HV, N, C(, V)] (read by the per-value-channel solve), or None
  dims: checks.Dims
  chunk_size: int
  dtype: jax.typing.DTypeLike  # the compute dtype
  precision: jax.lax.Precision  # of every matmul: HIGHEST for float32 callers, DEFAULT for bfloat16


def prepare(q, k, v, g=None, beta=None, *, scale=None, segment_ids=None, chunk_size: int = 64,
            solver: str = "blocked") -> Prepared:
  """The chunk-local stage: pad T to chunks of `chunk_size`, apply the in-chunk decays and the segment masks,
  and solve each chunk's unit-lower-triangular WY system. Arguments as `gated_delta_rule`; `solver`:
  "blocked" (the default blocked inverse) or "triangular" (a triangular solve)."""
  dims = checks.check_sequence(q, k, v, g, beta, None, segment_ids, scale, "chunk", chunk_size)
  loc, _, bc, _, cdt, prec = chunk.prepare(q, k, v, g, beta, scale=checks.default_scale(scale, dims.K),
                                           segment_ids=segment_ids, dims=dims, chunk_size=chunk_size,
                                           solver=solver)
  return Prepared(loc, bc, dims, chunk_size, cdt, prec)


def initial_state(p: Prepared, S0=None):
  """S0 in the compute dtype, zeros [B, HV, K, V] when None."""
  return chunk.initial(S0, p.dims, p.dtype)


def state_pass(p: Prepared, S0=None, *, method: str = "scan"):
  """The chunk-to-chunk recurrence S_{n+1} = Diag(decay_n) S_n + K_end_n^T U_n(S_n) from S0 (None: zeros).

  method: "scan" (sequential `lax.scan` over chunks, every variant), "associative" (log-depth scan over the
  chunks' affine maps; declines per-value-channel beta) or "pallas" (a Pallas kernel pair, every variant;
  compiled on GPUs, interpreted elsewhere). Returns (S_T, S_in, U) as described in the module docstring.
  """
  if method not in STATE_PASSES:
    raise ValueError(f"method must be one of {STATE_PASSES}, got {method!r}")
  if method == "associative" and p.dims.beta_kind == "channel":
    raise ValueError(f"state pass method={method!r} does not support per-value-channel beta; use method='scan' "
                     f"or 'pallas'")
  S0 = initial_state(p, S0)
  if method == "scan":
    return chunk.scan_chunks(p.local, p.beta, S0, p.precision)
  if method == "pallas":
    return pallas_chunk.state_pass(p.local, S0, p.precision, beta=p.beta)
  Mc, Bc = associative.cumulative_maps(p.local, p.precision)
  S_in, S_T = associative.states_from_maps(Mc, Bc, S0, p.precision)
  return S_T, S_in, chunk.write_vectors(p.local, S_in, p.beta, p.precision)


def finish(p: Prepared, S_in, U):
  """The output stage: o = Q_dec S_in + P U per chunk, back to [B, T, HV, V] (padding dropped)."""
  return chunk.finish(p.local, S_in, U, p.precision, p.dims, p.chunk_size)
