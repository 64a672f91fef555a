"""Sparse mixture-of-experts SwiGLU MLP: a softmax top-k router, routed experts, an optional gated shared expert,
and the Switch-style load-balancing loss.

Shapes: N tokens (B * T), D d_model, E experts, I an expert's hidden width, K experts per token (top_k).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdn.config import MoEConfig
from gdn.layers.mlp import SwiGLU


class Experts(nnx.Module):
  """E SwiGLU experts, weights stacked on a leading expert axis (which training shards over devices)."""

  def __init__(self, num_experts: int, d_model: int, hidden: int, *, init_std: float = 0.02, out_init_std=None,
               dtype=jnp.float32, rngs: nnx.Rngs):
    init = nnx.initializers.normal(init_std)
    out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    E, D, I = num_experts, d_model, hidden
    self.gate_proj = nnx.Param(init(rngs.params(), (E, D, I), jnp.float32))
    self.up_proj = nnx.Param(init(rngs.params(), (E, D, I), jnp.float32))
    self.down_proj = nnx.Param(out_init(rngs.params(), (E, I, D), jnp.float32))
    self.dtype = dtype

  def __call__(self, x_ND, idx_NK, w_NK):
    """sum_k w[n, k] * expert_{idx[n, k]}(x[n]), each expert running only on its own tokens: the N * K (token,
    expert) pairs are sorted by expert and multiplied group by group (`jax.lax.ragged_dot`)."""
    N, K = idx_NK.shape
    E = self.gate_proj.shape[0]
    flat = idx_NK.reshape(-1)
    order = jnp.argsort(flat)
    token = order // K
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    dot = lambda a, w: jax.lax.ragged_dot(a, w[...].astype(self.dtype), sizes, preferred_element_type=jnp.float32)
    xs = x_ND[token].astype(self.dtype)
    h = (jax.nn.silu(dot(xs, self.gate_proj)) * dot(xs, self.up_proj)).astype(self.dtype)
    ys = dot(h, self.down_proj) * w_NK.reshape(-1)[order][:, None].astype(jnp.float32)
    # The K contributions of a token are summed in float32, then cast once.
    return jnp.zeros((N, x_ND.shape[-1]), jnp.float32).at[token].add(ys).astype(x_ND.dtype)


class MoE(nnx.Module):
  """y = sum over the top_k experts of p_e * expert_e(x) (+ sigmoid(x . w_s) * shared(x)), p = softmax(router(x)),
  optionally renormalised over the top_k. Routing is per token and in float32."""

  def __init__(self, cfg: MoEConfig, d_model: int, *, init_std: float = 0.02, out_init_std=None,
               dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(cfg, MoEConfig):
      raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    self.cfg = cfg
    self.d_model = d_model
    init = nnx.initializers.normal(init_std)
    self.router = nnx.Linear(d_model, cfg.num_experts, use_bias=False, kernel_init=init, rngs=rngs)
    self.experts = Experts(cfg.num_experts, d_model, cfg.hidden, init_std=init_std, out_init_std=out_init_std,
                           dtype=dtype, rngs=rngs)
    self.shared_expert = (SwiGLU(d_model, cfg.shared_hidden, init_std=init_std, out_init_std=out_init_std,
                                 dtype=dtype, rngs=rngs) if cfg.shared_hidden else None)
    self.shared_gate = (nnx.Linear(d_model, 1, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)
                        if cfg.shared_hidden and cfg.shared_gate else None)

  def __call__(self, x, router_stats: Optional[list] = None):
    """x [..., D] -> y [..., D]. router_stats: a list to which this call appends its (fraction of the top_k
    assignments per expert [E], mean router probability per expert [E]) for `load_balancing_loss`."""
    if x.shape[-1] != self.d_model:
      raise ValueError(f"x must have last axis d_model={self.d_model}, got shape {x.shape}")
    cfg = self.cfg
    x_ND = x.reshape(-1, self.d_model)
    p_NE = jax.nn.softmax(self.router(x_ND.astype(jnp.float32)), axis=-1)
    w_NK, idx_NK = jax.lax.top_k(p_NE, cfg.top_k)
    if cfg.norm_topk:
      w_NK = w_NK / w_NK.sum(-1, keepdims=True)
    y = self.experts(x_ND, idx_NK, w_NK)
    if self.shared_expert is not None:
      s = self.shared_expert(x_ND)
      if self.shared_gate is not None:
        s = (jax.nn.sigmoid(self.shared_gate(x_ND).astype(jnp.float32)) * s.astype(jnp.float32)).astype(s.dtype)
      y = y + s
    if router_stats is not None:
      counts = jax.nn.one_hot(idx_NK, cfg.num_experts, dtype=jnp.float32).sum((0, 1))
      router_stats.append((counts / x_ND.shape[0], p_NE.mean(0)))
    return y.reshape(x.shape)


def load_balancing_loss(router_stats, num_experts: int):
  """Switch Transformer's E * sum_e f_e P_e, f_e the fraction of top_k assignments to expert e and P_e its mean
  router probability, each averaged over the MoE layers first (as transformers' Qwen3-Next computes it): top_k
  when routing is uniform, larger when it is not. 0 without MoE layers."""
  if not router_stats:
    return jnp.zeros((), jnp.float32)
  f = jnp.mean(jnp.stack([s[0] for s in router_stats]), 0)
  P = jnp.mean(jnp.stack([s[1] for s in router_stats]), 0)
  return num_experts * jnp.sum(f * P)
