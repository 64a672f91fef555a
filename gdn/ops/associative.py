"""Chunkwise gated delta rule with the chunk-to-chunk recurrence as `lax.associative_scan` (log depth in N).

Each chunk is the affine map S -> M_n S + B_n with M_n = Diag(e^{gamma_C}) - K_end^T W [K, K] and
B_n = K_end^T Unew [K, V]; maps compose as (M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2).
Shapes: B batch, HV value heads, N chunks, C chunk size, K key dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdn.ops import checks, intra_chunk
from gdn.ops.chunk import STATES, finish, initial, isolate_segments, prepare, write_vectors


def chunk_maps(loc: intra_chunk.Local, prec):
  """Per-chunk maps (M_n, B_n): M_n [B, HV, N, K, K], or without the delta rule (W is None) only its
  diagonal [B, HV, N, 1 or K], which keeps the scan (and a context-parallel all-gather) K times smaller."""
  dot = lambda spec, *xs: intra_chunk.mm(spec, *xs, precision=prec)
  Bn = dot("...ck,...cv->...kv", loc.k_end, loc.U)
  if loc.W is None:
    return loc.decay, Bn
  eye = jnp.eye(loc.k_end.shape[-1], dtype=Bn.dtype)
  return loc.decay[..., :, None] * eye - dot("...ck,...cj->...kj", loc.k_end, loc.W), Bn


def apply(M, X, prec):
  """M X for a full M [.., K, K], or for a diagonal M [.., 1 or K] (one axis fewer than X [.., K, V])."""
  if M.ndim < X.ndim:
    return M[..., None] * X
  return intra_chunk.mm("...ij,...jv->...iv", M, X, precision=prec)


def compose(first, then, prec):
  """The map `then o first` of two maps (M, B) (either or both stacked along leading axes)."""
  (m1, b1), (m2, b2) = first, then
  m = m2 * m1 if m1.ndim < b1.ndim else apply(m2, m1, prec)
  return m, apply(m2, b1, prec) + b2


@checks.scoped("state_pass")
def cumulative_maps(loc: intra_chunk.Local, prec, *, remat_scan: bool = False):
  """(Mc_n, Bc_n): the composition of chunks 0..n, for every n, by an associative scan along N. remat_scan:
  the backward recomputes the scan's intermediates instead of keeping them."""
  scan = functools.partial(jax.lax.associative_scan, functools.partial(compose, prec=prec), axis=2)
  return (jax.checkpoint(scan) if remat_scan else scan)(chunk_maps(loc, prec))


def states_from_maps(Mc, Bc, S0, prec):
  """Entering states S_in [B, HV, N, K, V] and the end state [B, HV, K, V] from cumulative maps and S0."""
  S_end = apply(Mc, S0[:, :, None], prec) + Bc
  S_in = jnp.concatenate([S0[:, :, None], S_end[:, :, :-1]], axis=2)
  return S_in, S_end[:, :, -1]


def associative(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size: int,
                remat: bool = False, local_groups: int = 1, g_lower_bound=None):
  """`method="associative"`; local_groups and g_lower_bound as `chunk`'s. Declines per-value-channel beta (its
  maps would be [V, K, K] per chunk)."""
  if dims.beta_kind == "channel":
    raise ValueError("method='associative' does not support per-value-channel beta ([B, T, HV, V]); "
                     "use method='chunk', 'pallas' or 'recurrent', or a per-head beta [B, T, HV]")

  chunk_size = min(chunk_size, dims.T)  # one chunk of T, not a chunk padded past the sequence

  def run(q, k, v, g, beta, initial_state, segment_ids):
    loc, vc, bc, N, cdt, prec = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                        chunk_size=chunk_size, local_groups=local_groups,
                                        g_lower_bound=g_lower_bound)
    Mc, Bc = cumulative_maps(loc, prec)
    S_in, S_T = states_from_maps(Mc, Bc, initial(initial_state, dims, cdt), prec)
    S_in = checkpoint_name(S_in, STATES)
    U = write_vectors(loc, S_in, bc, prec)
    return finish(loc, S_in, U, prec, dims, chunk_size), S_T

  if remat:
    run = jax.checkpoint(run, policy=jax.checkpoint_policies.save_only_these_names(STATES))
  return isolate_segments(run)(q, k, v, g, beta, initial_state, segment_ids)
