"""RMSNorm over the last axis, and its gated form RMSNorm(x) * act(gate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * weight, as torch.nn.RMSNorm; statistics in float32 whatever x's dtype."""

  def __init__(self, dim: int, *, eps: float = 1e-6):
    self.dim = dim
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x):
    if x.shape[-1] != self.dim:
      raise ValueError(f"x must have last axis {self.dim}, got shape {x.shape}")
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...]).astype(x.dtype)


class GatedRMSNorm(RMSNorm):
  """RMSNorm(x) * act(gate): the output norm of Gated DeltaNet (SiLU) and KDA (sigmoid)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, activation: str = "silu"):
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    super().__init__(dim, eps=eps)
    self.activation = activation

  def __call__(self, x, gate):
    if gate.shape != x.shape:
      raise ValueError(f"gate must have the shape of x {x.shape}, got {gate.shape}")
    act = ACTIVATIONS[self.activation](gate.astype(jnp.float32))
    return (super().__call__(x).astype(jnp.float32) * act).astype(x.dtype)
