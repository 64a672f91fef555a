"""Causal depthwise short convolution with a decoding state.

Shapes: B batch, T time (this device's slice under context parallelism), C channels, W kernel size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn.layers.segments import segment_index


class ShortConv(nnx.Module):
  """y_t = sum_j w[j] * x_{t-W+1+j} (+ b) per channel (w[W-1] weighs the current token), no activation.

  The weight [W, C] is torch's Conv1d(C, C, W, groups=C) weight [C, 1, W] transposed, the optional bias [C] its
  bias. The state carries the last W-1 inputs [B, W-1, C] (inputs, not outputs, so the bias is not in it), so
  decoding a token at a time or prefilling in pieces equals one full pass.
  """

  def __init__(self, channels: int, size: int, *, bias: bool = False, init_std: float = 0.02, dtype=jnp.float32,
               rngs: nnx.Rngs):
    if size < 1:
      raise ValueError(f"size must be a positive int, got {size!r}")
    self.channels = channels
    self.size = size
    self.dtype = dtype
    self.weight = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (size, channels), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((channels,), jnp.float32)) if bias else None

  def init_state(self, batch: int, dtype=None):
    return jnp.zeros((batch, self.size - 1, self.channels), dtype or self.dtype)

  def __call__(self, x, *, segment_ids=None, state=None, context_axis=None):
    """x [B, T, C]; segment_ids None or [B, T] (inputs of another segment do not reach a position);
    state None (zeros) or [B, W-1, C]. Returns (y [B, T, C], new state [B, W-1, C]).

    context_axis: None, or the name of a mesh axis over which the sequence is split (inside a `shard_map`):
    x and segment_ids are then this device's slice, and the last W-1 inputs of the previous device's slice
    take the state's place (zeros on the first device).
    """
    if x.ndim != 3 or x.shape[-1] != self.channels:
      raise ValueError(f"x must be [B, T, C] with C={self.channels}, got shape {x.shape}")
    B, T, C = x.shape
    W = self.size
    if segment_ids is not None and segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    if context_axis is not None:
      if state is not None:
        raise ValueError("a conv state cannot be combined with context_axis: the previous device's inputs "
                         "are the state")
      state, seg_before = _halo(x, segment_ids, W - 1, context_axis)
    elif state is None:
      state, seg_before = jnp.zeros((B, W - 1, C), x.dtype), None
    elif state.shape != (B, W - 1, C):
      raise ValueError(f"state must be [B, W-1, C] = {(B, W - 1, C)}, got {state.shape}")
    else:
      seg_before = None
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = self.weight[...].astype(x.dtype)
    if segment_ids is not None:
      if seg_before is None:
        # A state prefix belongs to no segment: packed sequences start from a clean window.
        sp = jnp.concatenate([jnp.full((B, W - 1), -1, jnp.int32), segment_index(segment_ids)], axis=1)
      else:
        # The previous slice's ids continue this one's: segments are numbered over the joined window. On the
        # first device the prefix inputs are zeros, so whatever segment they are given adds nothing.
        sp = segment_index(jnp.concatenate([seg_before, segment_ids], axis=1))
      seg = sp[:, W - 1:]
    y = jnp.zeros_like(x)
    for j in range(W):
      tap = xp[:, j:j + T] * w[j]
      if segment_ids is not None:
        tap = jnp.where((sp[:, j:j + T] == seg)[..., None], tap, 0)
      y = y + tap
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y, xp[:, T:]


def _halo(x, segment_ids, n: int, axis_name: str):
  """The last n steps of the previous device's slice along `axis_name`: x [B, T, C] -> [B, n, C] and
  segment_ids [B, T] -> [B, n] (None stays None); zeros on the first device, which has no predecessor."""
  B, T, C = x.shape
  if n == 0:
    return jnp.zeros((B, 0, C), x.dtype), None if segment_ids is None else segment_ids[:, :0]
  if T < n:
    raise ValueError(f"each device's slice must hold at least {n} steps (the conv size - 1) under context "
                     f"parallelism, got {T}")
  D = jax.lax.axis_size(axis_name)
  # ppermute sends device d's tail to d + 1; device 0 receives nothing, which ppermute fills with zeros.
  shift = lambda a: jax.lax.ppermute(a, axis_name, [(d, d + 1) for d in range(D - 1)])
  return shift(x[:, T - n:]), None if segment_ids is None else shift(segment_ids[:, T - n:])
