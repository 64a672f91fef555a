"""The token-level gated delta rule: one pure step, and `lax.scan` of it over time.

Shapes: B batch, T time, H q/k heads, HV value heads (a multiple of H), K key dim, V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn.ops import checks

_HI = jax.lax.Precision.HIGHEST


def expand_heads(x, HV: int, axis: int):
  """Repeat q/k heads so that value head i reads q/k head i // (HV // H)."""
  H = x.shape[axis]
  return x if H == HV else jnp.repeat(x, HV // H, axis=axis)


def _step(S, q, k, v, g, beta, scale):
  """One float32 step per value head. S [B,HV,K,V]; q,k [B,HV,K]; v [B,HV,V]; g/beta None or broadcastable."""
  if g is not None:
    a = jnp.exp(g)
    S = S * (a[..., None, None] if a.ndim == 2 else a[..., :, None])
  if beta is None:
    u = v
  else:
    pred = jnp.einsum("bhkv,bhk->bhv", S, k, precision=_HI)
    u = (beta[..., None] if beta.ndim == 2 else beta) * (v - pred)
  S = S + k[..., :, None] * u[..., None, :]
  o = jnp.einsum("bhkv,bhk->bhv", S, q * scale, precision=_HI)
  return o, S


def _f32(x):
  """float32 accumulation whatever the input dtype (float64 stays float64: the oracle tests use it)."""
  return None if x is None else x.astype(jnp.promote_types(jnp.float32, x.dtype))


def gated_delta_rule_step(q_t, k_t, v_t, g_t=None, beta_t=None, *, state, scale=None):
  """One token of the gated delta rule, per value head:

    S <- Diag(exp(g_t)) S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T  (S + k_t v_t^T if beta_t is None)
    o_t = S^T (scale * q_t)

  q_t, k_t [B, H, K]; v_t [B, HV, V]; g_t None/[B, HV]/[B, HV, K]; beta_t None/[B, HV]/[B, HV, V];
  state [B, HV, K, V]. Returns (o_t [B, HV, V] in v_t's dtype, new state float32).
  """
  d = checks.check_step(q_t, k_t, v_t, g_t, beta_t, state, scale)
  scale = checks.default_scale(scale, d.K)
  q = expand_heads(_f32(q_t), d.HV, 1)
  k = expand_heads(_f32(k_t), d.HV, 1)
  o, S = _step(_f32(state), q, k, _f32(v_t), _f32(g_t), _f32(beta_t), scale)
  return o.astype(v_t.dtype), S


def reset_flags(segment_ids, B: int, T: int):
  """[B, T] bool: True where the state restarts (the id differs from the previous position's)."""
  if segment_ids is None:
    return None
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return segment_ids != prev


def recurrent(q, k, v, g, beta, *, scale, initial_state, segment_ids, dims: checks.Dims, chunk_size=None):
  """`lax.scan` of the step over time. Inputs already validated; returns (o float32, S float32)."""
  B, HV = dims.B, dims.HV
  q = expand_heads(_f32(q), HV, 2)
  k = expand_heads(_f32(k), HV, 2)
  S0 = (jnp.zeros((B, HV, dims.K, dims.V), v.dtype) if initial_state is None else initial_state)
  S0 = _f32(S0)
  reset = reset_flags(segment_ids, B, dims.T)
  time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (q, k, _f32(v), _f32(g), _f32(beta), reset)))

  def body(S, x):
    q_t, k_t, v_t, g_t, b_t, r_t = x
    if r_t is not None:
      S = jnp.where(r_t[:, None, None, None], 0.0, S)
    o_t, S = _step(S, q_t, k_t, v_t, g_t, b_t, scale)
    return S, o_t

  S, o = jax.lax.scan(body, S0, xs)
  return jnp.moveaxis(o, 0, 1), S
