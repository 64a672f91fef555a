"""The short conv's own VJP (`conv.CONV_VJP`): the same forward, the gradients of JAX's autodiff, fewer residuals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.bench.residuals import residual_bytes, saved_residuals
from gdn.layers import conv as conv_mod
from gdn.layers.conv import ShortConv


def _setup(dtype, bias, segments, state):
  B, T, C, W = 2, 13, 24, 4
  conv = ShortConv(C, W, bias=bias, rngs=nnx.Rngs(0))
  if bias:
    conv.bias[...] = jax.random.normal(jax.random.key(5), (C,), jnp.float32) * 0.1
  conv.weight[...] = jax.random.normal(jax.random.key(1), (W, C), jnp.float32) * 0.5
  x = jax.random.normal(jax.random.key(2), (B, T, C), dtype)
  seg = jnp.array([[0] * 5 + [1] * 8, [3] * 9 + [7] * 4]) if segments else None
  s0 = jax.random.normal(jax.random.key(3), (B, W - 1, C), dtype) if state else None
  dy = jax.random.normal(jax.random.key(4), (B, T, C), jnp.float32)
  return conv, x, seg, s0, dy


def _loss(conv, x, seg, s0, dy, activation):
  graphdef, params = nnx.split(conv, nnx.Param)

  def f(params, x, s0):
    y, state = nnx.merge(graphdef, params)(x, segment_ids=seg, state=s0, activation=activation)
    f32 = jnp.promote_types(jnp.float32, y.dtype)  # float64 stays float64 for the finite differences
    return jnp.sum(y.astype(f32) * dy) + (0.0 if s0 is None else jnp.sum(state.astype(f32)))

  return f, params


def _off_and_on(monkeypatch, switch, f, params, x, s0):
  """((loss, grads) with the conv module's `switch` off, the same with it on); grads of the params, x and, where
  given, the state."""
  argnums = (0, 1) if s0 is None else (0, 1, 2)
  out = []
  for on in (False, True):
    monkeypatch.setattr(conv_mod, switch, on)
    out.append((jax.jit(f)(params, x, s0), jax.jit(jax.grad(f, argnums=argnums))(params, x, s0)))
  return out


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias,segments,state,activation", [
    (False, False, False, "silu"), (True, True, False, "silu"), (True, False, True, None), (False, True, True, None)])
def test_same_outputs_and_gradients_as_autodiff(monkeypatch, dtype, tol, bias, segments, state, activation):
  conv, x, seg, s0, dy = _setup(dtype, bias, segments, state)
  f, params = _loss(conv, x, seg, s0, dy, activation)
  (want, dwant), (got, dgot) = _off_and_on(monkeypatch, "CONV_VJP", f, params, x, s0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the forward is the same program
  for a, b in zip(jax.tree.leaves(dgot), jax.tree.leaves(dwant)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), (a, b)


def test_gradients_match_finite_differences_in_float64(monkeypatch):
  from jax.test_util import check_grads
  monkeypatch.setattr(conv_mod, "CONV_VJP", True)
  with jax.enable_x64(True):
    conv, x, seg, _, dy = _setup(jnp.float64, True, True, False)
    f, params = _loss(conv, x, seg, None, dy.astype(jnp.float64), "silu")
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    check_grads(lambda p, x: f(p, x, None), (params, x), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_keeps_only_the_padded_input(monkeypatch):
  conv, x, seg, _, dy = _setup(jnp.bfloat16, True, False, False)
  x = jnp.tile(x, (1, 20, 1))
  graphdef, params = nnx.split(conv, nnx.Param)
  f = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x, activation="silu")[0].astype(jnp.float32))
  kept = {}
  for on in (False, True):
    monkeypatch.setattr(conv_mod, "CONV_VJP", on)
    kept[on] = residual_bytes(saved_residuals(f, params, x))
  B, T, C = x.shape
  assert kept[True] < kept[False]
  # The padded input in bfloat16, plus the weight and bias (float32 copies in x's dtype), nothing per tap.
  assert kept[True] <= B * (T + 3) * C * 2 + 2 * 5 * C * 4, kept


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias,state,activation", [(False, False, "silu"), (True, True, "silu"), (True, False, None)])
def test_lax_conv_matches_the_taps(monkeypatch, dtype, tol, bias, state, activation):
  """CONV_LAX: the taps as one depthwise convolution; outputs and gradients (weight, bias, input, state) those of
  the taps' autodiff, to the dtype's rounding, and the program holds the convolution."""
  conv, x, _, s0, dy = _setup(dtype, bias, False, state)
  f, params = _loss(conv, x, None, s0, dy, activation)
  (want, dwant), (got, dgot) = _off_and_on(monkeypatch, "CONV_LAX", f, params, x, s0)
  assert "conv_general_dilated" in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(params, x, s0))
  assert abs(float(got) - float(want)) <= tol * max(1.0, abs(float(want)))
  for a, b in zip(jax.tree.leaves(dgot), jax.tree.leaves(dwant)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), (a, b)


def test_lax_conv_leaves_segments_to_the_taps(monkeypatch):
  """With segment ids CONV_LAX changes nothing: the per-tap mask is not a convolution, so the taps run."""
  conv, x, seg, _, dy = _setup(jnp.float32, True, True, False)
  f, params = _loss(conv, x, seg, None, dy, "silu")
  monkeypatch.setattr(conv_mod, "CONV_LAX", True)
  assert "conv_general_dilated" not in str(jax.make_jaxpr(jax.grad(f))(params, x, None))
