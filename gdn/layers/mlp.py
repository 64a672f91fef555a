"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn.layers.fused import fuse_projections, lean, project


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
    self.in_proj = None  # gate and up as one FusedLinear, after `fuse` (inference)

  def fuse(self, multiple: int | None = None):
    """In place, for inference: the gate and up projections become one matmul (and the down projection a
    `gdn.layers.fused.LeanLinear`, the same matmul with the inference path's handling of a few rows).
    multiple: first widen the hidden layer with zero columns of gate and up and zero rows of down to a multiple
    of this, which leaves the output as it was (silu(0) * 0 = 0 and the zero rows add nothing) but lets a matmul
    library tile the width without padding the weight in every call (XLA's split-K matmul on the H200 pads 5464
    rows to 5504 per step)."""
    if multiple is not None:
      if not (isinstance(multiple, int) and multiple >= 1):
        raise ValueError(f"multiple must be a positive int, got {multiple!r}")
      if self.in_proj is not None:
        raise ValueError("the MLP is already fused; widen it before fusing")
      hidden = self.down_proj.kernel.shape[-2]
      extra = -hidden % multiple
      if extra:
        for lin in (self.gate_proj, self.up_proj):
          w = lin.kernel[...]
          lin.kernel.set_value(jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, extra)]))
          lin.out_features = hidden + extra
        w = self.down_proj.kernel[...]
        self.down_proj.kernel.set_value(jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, extra), (0, 0)]))
        self.down_proj.in_features = hidden + extra
    fuse_projections(self, ("gate_proj", "up_proj"))
    self.down_proj = lean(self.down_proj)

  def __call__(self, x):
    p = project(self, ("gate_proj", "up_proj"), x)
    return self.down_proj(jax.nn.silu(p["gate_proj"]) * p["up_proj"])
