"""The q/k l2norm and the gated output norm with their own VJPs (`norms.NORM_VJP`): the same forward, autodiff's
gradients (to float32 rounding, their arithmetic; bfloat16 to its), and less kept for the backward."""

import jax
import jax.numpy as jnp
import pytest

from gdn.bench.residuals import residual_bytes, saved_residuals
from gdn.layers import norms
from gdn.layers.norms import GatedRMSNorm, l2norm
from tests.test_conv_kernel import assert_close, mixer_loss

pytestmark = pytest.mark.usefixtures("fast_compile")


def _norm_losses(activation):
  """loss(x, gate, weight) through l2norm and GatedRMSNorm, a new function each call (the switch is read at
  trace time and JAX caches traces by function)."""
  k = jax.random.split(jax.random.key(0), 2)
  c1, c2 = (jax.random.normal(kk, (2, 5, 3, 32), jnp.float32) for kk in k)

  def loss(x, gate, weight):
    norm = GatedRMSNorm(32, activation=activation)
    norm.weight[...] = weight
    return jnp.sum(l2norm(x).astype(jnp.float32) * c1) + jnp.sum(norm(x, gate).astype(jnp.float32) * c2)

  return loss


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_same_forward_and_the_gradients_of_autodiff(monkeypatch, activation, dtype, tol):
  """The norms compute in float32 whatever the inputs (as before): float32 rounding is the tolerance."""
  k = jax.random.split(jax.random.key(1), 3)
  x, gate = (jax.random.normal(kk, (2, 5, 3, 32), jnp.float32).astype(dtype) for kk in k[:2])
  weight = 1.0 + 0.1 * jax.random.normal(k[2], (32,), jnp.float32)
  out = {}
  for on in (False, True):
    monkeypatch.setattr(norms, "NORM_VJP", on)
    out[on] = jax.value_and_grad(_norm_losses(activation), argnums=(0, 1, 2))(x, gate, weight)
  assert float(out[True][0]) == float(out[False][0])  # the forward is the same program
  assert [a.dtype for a in jax.tree.leaves(out[True][1])] == [b.dtype for b in jax.tree.leaves(out[False][1])]
  assert_close(out[True][1], out[False][1], tol)


def test_the_layer_keeps_less_for_its_backward_and_computes_the_same_gradients(monkeypatch):
  make_loss, params, x = mixer_loss(jnp.bfloat16)
  kept, grads = {}, {}
  for on in (False, True):
    monkeypatch.setattr(norms, "NORM_VJP", on)
    kept[on] = residual_bytes(saved_residuals(make_loss(), params, x))
    grads[on] = jax.jit(jax.grad(make_loss(), argnums=(0, 1)))(params, x)
  assert kept[True] < kept[False] - 2 * 64 * 2 * 2 * 32 * 4  # at least two float32 [B, T, H, K] copies fewer
  assert_close(grads[True], grads[False], 3e-2)
