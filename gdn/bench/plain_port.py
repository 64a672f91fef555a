"""The baseline every op table carries: the gated delta rule as a straightforward JAX port writes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def plain_port(q, k, v, g, beta, *, chunk_size=64):
  """The baseline: how straightforward JAX ports write it. Per chunk, inside `lax.scan`: the masked
  triangular system by an explicit triangular solve, intra-chunk attention, state update; autodiff
  through everything (no rematerialisation). Per-head g and beta only. Shapes as `gated_delta_rule`."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, g, beta = f32(q) * K**-0.5, f32(k), f32(v), f32(g), f32(beta)
  to_chunks = lambda x: jnp.moveaxis(x.reshape((B, N, C) + x.shape[2:]), 1, 0)  # [N, B, C, H, ...]
  eye = jnp.eye(C, dtype=jnp.float32)
  lower = jnp.tril(jnp.ones((C, C), bool), -1)
  incl = jnp.tril(jnp.ones((C, C), bool))

  def body(S, xs):
    qc, kc, vc, gc, bc = xs  # [B, C, H, ...]
    gam = jnp.cumsum(gc, axis=1)  # [B, C, H]
    diff = gam[:, :, None, :] - gam[:, None, :, :]  # [B, C, C, H]
    decay = jnp.exp(jnp.where(incl[None, :, :, None], diff, -jnp.inf))
    kk = jnp.einsum("bthk,bihk->btih", kc, kc) * decay
    A = eye[None, :, :, None] + jnp.where(lower[None, :, :, None], kk * bc[:, :, None, :], 0.0)
    A = jnp.moveaxis(A, -1, 1)  # [B, H, C, C]
    rhs_w = jnp.moveaxis(kc * (bc * jnp.exp(gam))[..., None], 2, 1)
    rhs_u = jnp.moveaxis(vc * bc[..., None], 2, 1)
    w = jax.scipy.linalg.solve_triangular(A, rhs_w, lower=True)
    u = jax.scipy.linalg.solve_triangular(A, rhs_u, lower=True)
    u = u - jnp.einsum("bhck,bhkv->bhcv", w, S)
    qk = jnp.moveaxis(jnp.einsum("bthk,bihk->btih", qc, kc) * decay, -1, 1)
    qg = jnp.moveaxis(qc * jnp.exp(gam)[..., None], 2, 1)
    o = jnp.einsum("bhck,bhkv->bhcv", qg, S) + jnp.einsum("bhti,bhiv->bhtv", qk, u)
    gam_h = jnp.moveaxis(gam, -1, 1)  # [B, H, C]
    k_end = jnp.moveaxis(kc, 2, 1) * jnp.exp(gam_h[..., -1:] - gam_h)[..., None]
    S = S * jnp.exp(gam_h[..., -1])[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_end, u)
    return S, jnp.moveaxis(o, 1, 2)

  S0 = jnp.zeros((B, H, K, V), jnp.float32)
  S, o = jax.lax.scan(body, S0, tuple(map(to_chunks, (q, k, v, g, beta))))
  return jnp.moveaxis(o, 0, 1).reshape(B, T, H, V), S
