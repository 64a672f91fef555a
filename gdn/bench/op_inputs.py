"""The op benchmark's shape presets and its inputs: (B, T, H, D) with H = HV heads, K = V = D, or (B, T, H, K, V)
for value heads of another width (the 340M model's K = 256, V = 512); per-head beta and per-head g (Gated
DeltaNet) or per-key-channel g (KDA)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

PRESETS = {  # shapes and the methods timed on them
    "cpu": dict(shapes=[(1, 512, 4, 64), (1, 2048, 4, 64), (1, 8192, 4, 64)],
                methods=["recurrent", "plain_port", "chunk", "associative"]),
    "h200": dict(shapes=[(4, 2048, 16, 128), (2, 16384, 16, 128), (1, 8192, 96, 128), (4, 4096, 64, 128),
                         (8, 1024, 8, 64)],
                 methods=["plain_port", "chunk", "associative", "pallas"]),
    "memory": dict(shapes=[(1, 65536, 4, 64)], methods=["chunk", "chunk_remat", "associative", "pallas"]),
    "long": dict(shapes=[(1, 65536, 2, 64), (1, 262144, 1, 64)], methods=["chunk", "associative", "pallas"]),
}


def dims(shape):
  """(B, T, H, K, V) of a shape (B, T, H, D) (K = V = D) or (B, T, H, K, V); a clear error for anything else."""
  if len(shape) not in (4, 5) or not all(isinstance(n, (int, np.integer)) and n > 0 for n in shape):
    raise ValueError(f"shape must be B,T,H,D or B,T,H,K,V of positive integers, got {tuple(shape)}")
  return tuple(int(n) for n in shape) + ((int(shape[3]),) if len(shape) == 4 else ())


def inputs(shape, dtype, g_kind="head", g_dtype=None):
  """q, k (unit rows), v, g (log-decays in [log 0.9, 0]), beta in (0, 1): the arrays every row times, for a
  shape (B, T, H, D) or (B, T, H, K, V) (q, k [B, T, H, K], v [B, T, H, V]; the same draws as (B, T, H, D) when
  K = V = D). g is [B, T, H] for g_kind "head" and [B, T, H, K] (one decay per key channel, KDA's gate) for
  "channel", in g_dtype (default: dtype). Returns the list and the generator, drawn on for anything else the row
  needs."""
  if g_kind not in ("head", "channel"):
    raise ValueError(f"g_kind must be 'head' or 'channel', got {g_kind!r}")
  B, T, H, K, V = dims(shape)
  g_shape = (B, T, H) if g_kind == "head" else (B, T, H, K)
  rng = np.random.default_rng(0)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  args = [jnp.asarray(rng.normal(size=(B, T, H, K)), dtype), jnp.asarray(k, dtype),
          jnp.asarray(rng.normal(size=(B, T, H, V)), dtype),
          jnp.asarray(np.log(rng.uniform(0.9, 1.0, g_shape)), g_dtype or dtype),
          jnp.asarray(rng.uniform(0, 1, (B, T, H)), dtype)]
  return args, rng
