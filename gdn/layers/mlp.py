"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def hidden_size(d_model: int, mlp_ratio: float) -> int:
  """int(mlp_ratio * 2/3 * d_model) rounded up to a multiple of 8, so the parameter count matches a GELU MLP."""
  h = int(mlp_ratio * 2 / 3 * d_model)
  return max(8, -(-h // 8) * 8)


class SwiGLU(nnx.Module):

  def __init__(self, d_model: int, hidden: int, *, init_std: float = 0.02, out_init_std=None, dtype=jnp.float32,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(init_std)
    out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    self.gate_proj = nnx.Linear(d_model, hidden, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)
    self.up_proj = nnx.Linear(d_model, hidden, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, d_model, use_bias=False, kernel_init=out_init, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
