"""Packed-sequence bookkeeping and call checks shared by the layers that mix across time."""

from __future__ import annotations

import jax.numpy as jnp


def segment_index(segment_ids):
  """[B, T] ids -> [B, T] int32 running segment numbers. A new segment starts wherever the id differs from the
  previous position's (the rule of `gdn.ops`), so a reused id, as in [0, 0, 1, 0], still starts a new one."""
  starts = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                           axis=1)
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def check_mixer_call(x, d_model: int, segment_ids, cache) -> None:
  """The checks every time-mixing layer's __call__ makes before it computes anything."""
  if x.ndim != 3 or x.shape[-1] != d_model:
    raise ValueError(f"x must be [B, T, d_model] with d_model={d_model}, got shape {x.shape}")
  if cache is not None and segment_ids is not None:
    raise ValueError("segment_ids cannot be combined with a cache: pass one sequence per batch row")
