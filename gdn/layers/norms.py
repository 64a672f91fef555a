"""RMSNorm over the last axis, and its gated form RMSNorm(x) * act(gate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}
# The l2norm of q and k (`l2norm`) and the gated output norm (`GatedRMSNorm`) with their own VJPs, which keep
# the inputs in their own dtype and one float32 inverse norm per row, and recompute the normalised rows in the
# backward; JAX's autodiff keeps float32 copies of the inputs, the normalised rows and the gate (on CPU, one
# Gated DeltaNet layer's 6,144 + 2,048 bytes a token of its largest kept tensors). The forward is the same
# program; gradients equal autodiff's to float32 rounding (`tests/test_norm_vjp.py`). Off: on the H200 the layer's
# time and peak are unchanged (`experiments/bench_layer_fla.py --switch layers.norms.NORM_VJP=off,on`,
# docs/benchmarks.md). Read at trace time.
NORM_VJP = False


def _l2norm_fwd(x, eps):
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * r).astype(x.dtype), (x, r)


def _l2norm_bwd(eps, res, dy):
  x, r = res
  y = x.astype(jnp.float32) * r
  dy = dy.astype(jnp.float32)
  return ((r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))).astype(x.dtype),)


_l2norm_vjp = jax.custom_vjp(lambda x, eps: _l2norm_fwd(x, eps)[0], nondiff_argnums=(1,))
_l2norm_vjp.defvjp(_l2norm_fwd, _l2norm_bwd)


def l2norm(x, eps: float = 1e-6):
  """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (the seed's and fla's l2norm), in x's dtype."""
  return _l2norm_vjp(x, eps) if NORM_VJP else _l2norm_fwd(x, eps)[0]


def _gated_rms_fwd(x, gate, weight, eps, activation):
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  act = ACTIVATIONS[activation](gate.astype(jnp.float32))
  out = ((x32 * r * weight).astype(x.dtype).astype(jnp.float32) * act).astype(x.dtype)
  return out, (x, gate, weight, r)


def _gated_rms_bwd(eps, activation, res, dout):
  x, gate, weight, r = res
  y = x.astype(jnp.float32) * r
  act, act_vjp = jax.vjp(ACTIVATIONS[activation], gate.astype(jnp.float32))
  normed = (y * weight).astype(x.dtype).astype(jnp.float32)  # the forward rounds the norm's output to x's dtype
  dout = dout.astype(jnp.float32)
  (dgate,) = act_vjp(dout * normed)
  dn = dout * act
  dweight = jnp.sum((dn * y).reshape(-1, y.shape[-1]), axis=0)
  dy = dn * weight
  dx = r * (dy - y * jnp.mean(y * dy, axis=-1, keepdims=True))
  return dx.astype(x.dtype), dgate.astype(gate.dtype), dweight.astype(weight.dtype)


_gated_rms = jax.custom_vjp(lambda *args: _gated_rms_fwd(*args)[0], nondiff_argnums=(3, 4))
_gated_rms.defvjp(_gated_rms_fwd, _gated_rms_bwd)


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
    if NORM_VJP:
      return _gated_rms(x, gate, self.weight[...], self.eps, self.activation)
    act = ACTIVATIONS[self.activation](gate.astype(jnp.float32))
    return (super().__call__(x).astype(jnp.float32) * act).astype(x.dtype)
