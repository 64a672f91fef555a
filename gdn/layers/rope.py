"""Rotary position embeddings: plain RoPE and YaRN's rescaled frequencies (arXiv:2309.00071).

Shapes: T positions, N heads, E head dim, R rotated dims (the first R of each head), R/2 frequencies.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from gdn.config import AttentionConfig


def yarn_attention_factor(factor: float) -> float:
  """YaRN's default cos/sin magnitude 0.1 ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def frequencies(cfg: AttentionConfig, rot_dim: int) -> tuple:
  """(inverse frequencies [R/2] float32 NumPy, magnitude of cos/sin) for `cfg.rope_scaling`.

  "none": theta^(-2i/R), magnitude 1. "yarn": the frequencies of the dims that turn fewer than beta_slow times
  over the original context are divided by `rope_factor` (interpolated), those that turn more than beta_fast
  times are kept, with a linear ramp between; cos and sin are multiplied by `rope_attention_factor` (so the
  attention logits by its square).
  """
  half = rot_dim // 2
  inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) / max(half, 1))
  if cfg.rope_scaling == "none":
    return inv_freq.astype(np.float32), 1.0
  # Computed in float64 and rounded once: the ramp's boundaries come from logs of the original context.
  def dim_of(turns):
    return rot_dim * math.log(cfg.rope_original_max_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
  low, high = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rot_dim - 1)
  if low == high:
    high += 0.001  # a step, not a division by zero
  ramp = np.clip((np.arange(half, dtype=np.float32) - low) / (high - low), 0, 1)  # 0: keep, 1: interpolate
  inv_freq = inv_freq.astype(np.float32)
  inv_freq = inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)
  scale = cfg.rope_attention_factor
  return inv_freq.astype(np.float32), float(yarn_attention_factor(cfg.rope_factor) if scale is None else scale)


def rope(x, positions, inv_freq, scale: float = 1.0):
  """Rotate the first R = 2 len(inv_freq) dims of each head (NeoX half-split pairs) by positions * inv_freq,
  cos and sin times `scale`; x [B, T, N, E], positions [T]."""
  half = len(inv_freq)
  if half == 0:
    return x
  rot_dim = 2 * half
  ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)  # [T, R/2]
  cos, sin = (scale * jnp.cos(ang))[None, :, None], (scale * jnp.sin(ang))[None, :, None]
  xr = x[..., :rot_dim].astype(jnp.float32)
  x1, x2 = xr[..., :half], xr[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([rotated, x[..., rot_dim:]], axis=-1)
