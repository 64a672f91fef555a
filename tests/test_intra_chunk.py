"""`intra_chunk.invert_unit_lower`'s hand-written VJP against autodiff of the same forward substitution and of
`jnp.linalg.inv`, at the block sizes the chunk form uses (C = 64 in blocks of 16, one block, a C that is not a
power-of-two multiple of the block)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.ops import intra_chunk

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.mark.parametrize("C", [64, 16, 12])
def test_inverse_vjp_equals_autodiff(C):
  rng = np.random.default_rng(C)
  # Strictly lower part as in the chunk form (beta * decayed k k^T), with junk above it that must get no gradient.
  L = jnp.asarray(rng.normal(size=(3, C, C)) * 0.3, jnp.float32)
  ct = jnp.asarray(rng.normal(size=(3, C, C)), jnp.float32)
  strict = jnp.tril(jnp.ones((C, C), bool), -1)

  @jax.jit  # one program, not a few hundred eager dispatches
  def forms(L, ct):
    T, vjp = jax.vjp(lambda L: intra_chunk.invert_unit_lower(L, jax.lax.Precision.HIGHEST), L)
    T_ref, vjp_ref = jax.vjp(lambda L: intra_chunk._invert_unit_lower(L, jax.lax.Precision.HIGHEST, 16), L)
    return T, T_ref, vjp(ct)[0], vjp_ref(ct)[0]

  T, T_ref, dL, dL_ref = forms(L, ct)
  # LAPACK's inverse op by op: inside one compiled program, in a process that has loaded torch (the interop tests
  # before this module on the same pytest-xdist worker), its calls have hung XLA:CPU's executor (about 1 run in 3).
  _, vjp_inv = jax.vjp(lambda L: jnp.linalg.inv(jnp.eye(C) + jnp.where(strict, L, 0.0)), L)
  (dL_inv,) = vjp_inv(ct)
  np.testing.assert_array_equal(np.asarray(T), np.asarray(T_ref))
  scale = float(jnp.max(jnp.abs(dL_ref)))
  assert float(jnp.max(jnp.abs(dL - dL_ref))) < 1e-5 * scale
  assert float(jnp.max(jnp.abs(dL - dL_inv))) < 1e-5 * scale
  assert not np.any(np.asarray(dL)[:, ~np.asarray(strict)])  # the diagonal and above are never read
