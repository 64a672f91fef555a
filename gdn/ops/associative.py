"""Chunkwise gated delta rule with the chunk-to-chunk recurrence as `lax.associative_scan` (log depth in N).

Each chunk is the affine map S -> M_n S + B_n with M_n = Diag(e^{gamma_C}) - K_end^T W [K, K] and
B_n = K_end^T Unew [K, V]; maps compose as (M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2).
Shapes: B batch, HV value heads, N chunks, C chunk size, K key dim, V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdn.ops import checks
from gdn.ops.chunk import STATES, finish, initial, prepare, write_vectors


def associative(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size: int,
                remat: bool = True):
  """`method="associative"`. Declines per-value-channel beta (its maps would be [V, K, K] per chunk)."""
  if dims.beta_kind == "channel":
    raise ValueError("method='associative' does not support per-value-channel beta ([B, T, HV, V]); "
                     "use method='chunk' or 'recurrent', or a per-head beta [B, T, HV]")

  def run(q, k, v, g, beta, initial_state, segment_ids):
    loc, vc, bc, N, cdt, prec = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                        chunk_size=chunk_size)
    dot = lambda spec, *xs: jnp.einsum(spec, *xs, precision=prec)
    Bn = dot("...ck,...cv->...kv", loc.k_end, loc.U)  # [B, HV, N, K, V]
    S0 = initial(initial_state, dims, cdt)
    if loc.W is None:
      # No delta rule: M_n is diagonal, kept as its diagonal [.., 1 or K].
      def combine(a, b):
        (m1, b1), (m2, b2) = a, b
        return m2 * m1, m2[..., None] * b1 + b2
      Mc, Bc = jax.lax.associative_scan(combine, (loc.decay, Bn), axis=2)
      S_end = Mc[..., None] * S0[:, :, None] + Bc
    else:
      K = dims.K
      eye = jnp.eye(K, dtype=cdt)
      Mn = loc.decay[..., :, None] * eye - dot("...ck,...cj->...kj", loc.k_end, loc.W)  # [.., K, K]
      def combine(a, b):
        (m1, b1), (m2, b2) = a, b
        return dot("...ij,...jk->...ik", m2, m1), dot("...ij,...jv->...iv", m2, b1) + b2
      Mc, Bc = jax.lax.associative_scan(combine, (Mn, Bn), axis=2)
      S_end = dot("...ij,...jv->...iv", Mc, S0[:, :, None]) + Bc
    S_in = jnp.concatenate([S0[:, :, None], S_end[:, :, :-1]], axis=2)
    S_in = checkpoint_name(S_in, STATES)
    U = write_vectors(loc, S_in, bc, prec)
    return finish(loc, S_in, U, prec, dims, chunk_size), S_end[:, :, -1]

  if remat:
    run = jax.checkpoint(run, policy=jax.checkpoint_policies.save_only_these_names(STATES))
  return run(q, k, v, g, beta, initial_state, segment_ids)
