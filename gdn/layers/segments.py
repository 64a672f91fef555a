"""Packed-sequence bookkeeping shared by the layers that mix across time (short conv, attention)."""

from __future__ import annotations

import jax.numpy as jnp


def segment_index(segment_ids):
  """[B, T] ids -> [B, T] int32 running segment numbers. A new segment starts wherever the id differs from the
  previous position's (the rule of `gdn.ops`), so a reused id, as in [0, 0, 1, 0], still starts a new one."""
  starts = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                           axis=1)
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)
