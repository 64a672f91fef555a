"""Causal depthwise short convolution with a decoding state.

Shapes: B batch, T time, C channels, W kernel size.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from gdn.layers.segments import segment_index


class ShortConv(nnx.Module):
  """y_t = sum_j w[j] * x_{t-W+1+j} per channel (w[W-1] weighs the current token), no bias, no activation.

  The weight [W, C] is torch's Conv1d(C, C, W, groups=C) weight [C, 1, W] transposed. The state carries the
  last W-1 inputs [B, W-1, C], so decoding a token at a time or prefilling in pieces equals one full pass.
  """

  def __init__(self, channels: int, size: int, *, init_std: float = 0.02, dtype=jnp.float32, rngs: nnx.Rngs):
    if size < 1:
      raise ValueError(f"size must be a positive int, got {size!r}")
    self.channels = channels
    self.size = size
    self.dtype = dtype
    self.weight = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (size, channels), jnp.float32))

  def init_state(self, batch: int, dtype=None):
    return jnp.zeros((batch, self.size - 1, self.channels), dtype or self.dtype)

  def __call__(self, x, *, segment_ids=None, state=None):
    """x [B, T, C]; segment_ids None or [B, T] (inputs of another segment do not reach a position);
    state None (zeros) or [B, W-1, C]. Returns (y [B, T, C], new state [B, W-1, C])."""
    if x.ndim != 3 or x.shape[-1] != self.channels:
      raise ValueError(f"x must be [B, T, C] with C={self.channels}, got shape {x.shape}")
    B, T, C = x.shape
    W = self.size
    if state is None:
      state = jnp.zeros((B, W - 1, C), x.dtype)
    elif state.shape != (B, W - 1, C):
      raise ValueError(f"state must be [B, W-1, C] = {(B, W - 1, C)}, got {state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = self.weight[...].astype(x.dtype)
    if segment_ids is not None:
      seg = segment_index(segment_ids)
      # The state prefix belongs to no segment (-1): packed sequences start from a clean window.
      sp = jnp.concatenate([jnp.full((B, W - 1), -1, seg.dtype), seg], axis=1)
    y = jnp.zeros_like(x)
    for j in range(W):
      tap = xp[:, j:j + T] * w[j]
      if segment_ids is not None:
        tap = jnp.where((sp[:, j:j + T] == seg)[..., None], tap, 0)
      y = y + tap
    return y, xp[:, T:]
