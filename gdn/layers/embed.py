"""The token embedding's lookup, with a gradient that does not depend on how often a token repeats.

`jnp.take(table, tokens, axis=0)` differentiates to a scatter-add of every position's cotangent into its token's
row. On a GPU that scatter is atomic adds, and they serialise where many positions hold the same token, as text's
runs of one byte (indentation, spaces) do: the same program's step took 103 ms on the corpus' bytes against
28.5 ms on uniform random tokens (one H200, 6 layers at d_model 512, 64 x 512 bytes a step; docs/benchmarks.md,
"The language-model grids' step"), and the scatter is its one operation whose cost depends on the tokens.
With a small vocabulary the table's gradient is cheaper as a matmul, one_hot(tokens)^T @ cotangent ([V, N] x
[N, D], float32 accumulation), whose time does not depend on the tokens.

`embed_lookup` takes that matmul on accelerators when the table has at most `ONEHOT_GRAD_MAX_VOCAB` rows (the
forward stays a gather); on the CPU, which adds without atomics, and for larger vocabularies (where the matmul's
2 N V D FLOP outgrow the scatter) it is `jnp.take`. `ONEHOT_GRAD` forces either (`bench_model --switch
layers.embed.ONEHOT_GRAD=off`, `=on`). Both sum the table's gradient in float32 (the table's dtype), whatever the
compute dtype, so values and gradients are the same either way up to summation order
(tests/test_embed.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# A module switch like gdn.ops' switches, read at trace time: None (auto) takes the one-hot matmul on every backend
# but the CPU for tables of at most ONEHOT_GRAD_MAX_VOCAB rows; True takes it always, False never.
ONEHOT_GRAD = None
ONEHOT_GRAD_MAX_VOCAB = 1024


def uses_onehot_grad(vocab: int) -> bool:
  """Whether `embed_lookup` differentiates a `vocab`-row table by the one-hot matmul here."""
  if ONEHOT_GRAD not in (None, True, False):
    raise ValueError(f"gdn.layers.embed.ONEHOT_GRAD must be None (auto), True or False, got {ONEHOT_GRAD!r}")
  if ONEHOT_GRAD is not None:
    return ONEHOT_GRAD
  return vocab <= ONEHOT_GRAD_MAX_VOCAB and jax.default_backend() != "cpu"


def embed_lookup(table, tokens, dtype=None):
  """table[tokens] ([V, D] and integer [...] -> [..., D]) in `dtype` (default the table's): `nnx.Embed`'s
  lookup, with the table's gradient as described in the module docstring. Tokens outside [0, V) read NaN rows,
  as `jnp.take` does, and add nothing to the gradient."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  dtype = table.dtype if dtype is None else jnp.dtype(dtype)
  if uses_onehot_grad(table.shape[0]):
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
