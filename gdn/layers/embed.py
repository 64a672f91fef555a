"""The token embedding's lookup: a gather whose table gradient sums in float32, by scatter-add or one-hot matmul.

`jnp.take(table, tokens, axis=0)` differentiates to a scatter-add of every position's cotangent into its token's
row. `embed_lookup` gathers in the table's dtype (float32) and casts after, so that those sums run in float32
whatever the compute dtype (casting the table first would add bfloat16 cotangents in bfloat16, and a byte-level
corpus sends a fifth of all positions to the one row of the space byte).

`ONEHOT_GRAD = True` computes the table's gradient instead as one_hot(tokens)^T @ cotangent ([V, N] x [N, D],
float32 accumulation), whose time cannot depend on how often a token repeats. It was built on the suspicion that
the GPU's atomic scatter serialises on text's repeated bytes; measured, it does not: on one H200 the language-model
ablations' step (6 layers, d_model 512, 64 x 512 bytes) takes 28.7 ms with the scatter and 29.8 ms with the matmul
on a batch of the corpus' bytes, 29.2 / 29.1 ms on uniform random tokens
(results/benchmarks/h200_2026-12-02/embed_probe.txt). The scatter stays the default; the switch stays for other
vocabularies and devices (`bench_model --switch layers.embed.ONEHOT_GRAD=on` times it). Both give the same values
and gradients up to summation order (tests/test_embed.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# A module switch like gdn.ops' switches, read at trace time: False (the default) differentiates the gather by its
# scatter-add, True by the one-hot matmul.
ONEHOT_GRAD = False


def uses_onehot_grad() -> bool:
  """Whether `embed_lookup` differentiates the table by the one-hot matmul."""
  if ONEHOT_GRAD not in (True, False):
    raise ValueError(f"gdn.layers.embed.ONEHOT_GRAD must be True or False, got {ONEHOT_GRAD!r}")
  return ONEHOT_GRAD


def embed_lookup(table, tokens, dtype=None):
  """table[tokens] ([V, D] and integer [...] -> [..., D]) in `dtype` (default the table's): `nnx.Embed`'s
  lookup, with the table's gradient as described in the module docstring. Tokens outside [0, V) read NaN rows,
  as `jnp.take` does, and add nothing to the gradient."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  dtype = table.dtype if dtype is None else jnp.dtype(dtype)
  if uses_onehot_grad():
    return _take_onehot_grad(table, tokens, dtype)
  # Gathered in the table's dtype and cast after (the same values as casting first), so that the gradient's
  # scatter-add sums in the table's dtype (float32) rather than the compute dtype.
  return jnp.take(table, tokens, axis=0).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_onehot_grad(table, tokens, dtype):
  return jnp.take(table, tokens, axis=0).astype(dtype)


def _fwd(table, tokens, dtype):
  return _take_onehot_grad(table, tokens, dtype), (table, tokens)


def _bwd(dtype, res, ct):
  table, tokens = res
  V, D = table.shape
  onehot = jax.nn.one_hot(tokens.reshape(-1), V, dtype=ct.dtype)  # out-of-range tokens: a zero row
  d_table = jnp.einsum("nv,nd->vd", onehot, ct.reshape(-1, D), preferred_element_type=jnp.float32)
  return d_table.astype(table.dtype), np.zeros(tokens.shape, jax.dtypes.float0)


_take_onehot_grad.defvjp(_fwd, _bwd)
