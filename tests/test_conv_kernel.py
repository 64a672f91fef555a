"""The short conv as Pallas kernels (`gdn.layers.conv_kernel`, `conv.CONV_KERNEL`; Pallas' interpreter on CPU):
the taps' outputs and gradients in float64 to rounding, `ShortConv` and the Gated DeltaNet layer the same with
the switch on as off (a mixer's q, k, v convolved as parts), and the shapes the kernels decline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import recurrent_preset
from gdn.layers import conv as conv_mod
from gdn.layers import conv_kernel
from gdn.layers.conv import ShortConv
from gdn.layers.recurrent import RecurrentMixer

pytestmark = pytest.mark.usefixtures("fast_compile")


def _taps(x, state, w, b, keep, activation):
  """The reference: the taps of `conv` on [state; x]."""
  xp = jnp.concatenate([state, x], axis=1)
  return conv_mod._activate(conv_mod._taps(xp, w, b, keep, x.shape[1]), activation)


@pytest.mark.parametrize("B,T,C,W,bias,segments,activation", [
    (2, 64, 32, 4, False, False, "silu"),   # one block of time
    (2, 128, 48, 4, True, True, "silu"),    # two blocks, the taps masked at segment starts, a bias
    (1, 96, 64, 3, True, False, None),      # three blocks of 32, three taps
    (2, 32, 16, 1, False, True, None),      # one tap: no state
])
@pytest.mark.parametrize("fused", [False, True])  # the backward as one kernel (segment masks keep the two)
def test_the_kernels_give_the_taps_outputs_and_gradients_in_float64(monkeypatch, B, T, C, W, bias, segments,
                                                                    activation, fused):
  monkeypatch.setattr(conv_kernel, "FUSED_BWD", fused)
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.key(0), 6)
    f64 = jnp.float64
    x, state = jax.random.normal(k[0], (B, T, C), f64), jax.random.normal(k[1], (B, W - 1, C), f64)
    w, b = jax.random.normal(k[2], (W, C), f64), (jax.random.normal(k[3], (C,), f64) if bias else None)
    keep = jax.random.uniform(k[4], (B, T, W)) > 0.3 if segments else None
    dy = jax.random.normal(k[5], (B, T, C), f64)
    loss = lambda fn: lambda x, s, w, b: jnp.sum(fn(x, s, w, b, keep, activation) * dy)
    got = jax.jit(jax.value_and_grad(loss(conv_kernel.short_conv), argnums=(0, 1, 2, 3)))(x, state, w, b)
    want = jax.jit(jax.value_and_grad(loss(_taps), argnums=(0, 1, 2, 3)))(x, state, w, b)
    np.testing.assert_allclose(conv_kernel.short_conv(x, state, w, b, keep, activation),
                               _taps(x, state, w, b, keep, activation), rtol=1e-12, atol=1e-12)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-11)
    assert (got[1][3] is None) == (not bias)


def assert_close(got, want, tol):
  """Every leaf of `got` within tol of `want`'s, relative to the leaf's largest magnitude (at least 1)."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b)))


def mixer_loss(dtype):
  """(make_loss, params, x) of a small Gated DeltaNet layer: make_loss() gives a new loss function each call, as
  the module switches are read at trace time and JAX caches traces by function."""
  cfg = recurrent_preset("gated_deltanet", num_heads=2, head_dim=32, method="chunk", chunk_size=32)
  graphdef, params, rest = nnx.split(RecurrentMixer(cfg, 64, rngs=nnx.Rngs(0)), nnx.Param, ...)
  x = jax.random.normal(jax.random.key(1), (2, 64, 64), dtype)

  def make_loss():
    def loss(params, x):
      y, _ = nnx.merge(graphdef, params, rest)(x)
      return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    return loss

  return make_loss, params, x


def _conv_loss(conv, seg, s0, dy, parts):
  graphdef, params = nnx.split(conv, nnx.Param)

  def f(params, x, s0):
    xs = tuple(jnp.split(x, parts, axis=-1)) if parts else x
    y, state = nnx.merge(graphdef, params)(xs, segment_ids=seg, state=s0, activation="silu")
    y = jnp.concatenate(y, axis=-1) if parts else y
    return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(jnp.sin(state.astype(jnp.float32)))

  return f, params


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("parts,segments,state", [((), False, False), ((16, 32), True, True), ((32, 48), False, True)])
def test_short_conv_with_the_kernels_matches_the_taps(monkeypatch, dtype, tol, parts, segments, state):
  """`ShortConv` with CONV_KERNEL on and off: the same outputs, new state and gradients (parameters, input,
  state), whole or given as channel parts (bfloat16: the kernels sum in float32, the taps in bfloat16)."""
  B, T, C, W = 2, 64, 64, 4
  conv = ShortConv(C, W, bias=True, rngs=nnx.Rngs(0))
  conv.weight[...] = jax.random.normal(jax.random.key(1), (W, C)) * 0.5
  conv.bias[...] = jax.random.normal(jax.random.key(5), (C,)) * 0.1
  x = jax.random.normal(jax.random.key(2), (B, T, C), dtype)
  seg = jnp.array([[0] * 20 + [1] * 44, [3] * 50 + [7] * 14]) if segments else None
  s0 = jax.random.normal(jax.random.key(3), (B, W - 1, C), dtype) if state else None
  dy = jax.random.normal(jax.random.key(4), (B, T, C), jnp.float32)
  out = []
  for on in (False, True):
    # A new function each time: the switch is read at trace time, and JAX caches traces by function.
    f, params = _conv_loss(conv, seg, s0, dy, list(parts))
    monkeypatch.setattr(conv_mod, "CONV_KERNEL", on)
    argnums = (0, 1) if s0 is None else (0, 1, 2)
    out.append(jax.jit(jax.value_and_grad(f, argnums=argnums))(params, x, s0))
    assert ("gdn_short_conv" in str(jax.make_jaxpr(f)(params, x, s0))) == on
  (want, dwant), (got, dgot) = out
  assert abs(float(got) - float(want)) <= tol * abs(float(want))
  assert_close(dgot, dwant, tol)


def test_the_fused_backward_matches_the_two_kernels_in_bfloat16(monkeypatch):
  """FUSED_BWD rounds dpre to the input's dtype as the two kernels do: gradients (input, state, weight, bias) of
  bfloat16 parts agree to float32 rounding, and the one kernel replaces the two."""
  B, T, C, W = 2, 64, 64, 4
  conv = ShortConv(C, W, bias=True, rngs=nnx.Rngs(0))
  conv.weight[...] = jax.random.normal(jax.random.key(1), (W, C)) * 0.5
  x = jax.random.normal(jax.random.key(2), (B, T, C), jnp.bfloat16)
  s0 = jax.random.normal(jax.random.key(3), (B, W - 1, C), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(4), (B, T, C), jnp.float32)
  monkeypatch.setattr(conv_mod, "CONV_KERNEL", True)
  out = []
  for fused in (False, True):
    monkeypatch.setattr(conv_kernel, "FUSED_BWD", fused)
    f, params = _conv_loss(conv, None, s0, dy, [16, 48])
    grad = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(params, x, s0))
    assert ("gdn_short_conv_bwd_fused" in jaxpr) == fused and ("gdn_short_conv_bwd_dx" in jaxpr) != fused
    out.append(grad(params, x, s0))
  assert_close(out[1], out[0], 1e-2)  # bfloat16 dx: one rounding apart at most


def test_the_gated_deltanet_layer_is_the_same_with_the_kernels(monkeypatch):
  """The mixer hands its q, k and v to the conv as parts: float32 outputs and gradients as with the taps."""
  make_loss, params, x = mixer_loss(jnp.float32)
  got = {}
  for on in (False, True):
    monkeypatch.setattr(conv_mod, "CONV_KERNEL", on)
    loss = make_loss()
    assert ("gdn_short_conv" in str(jax.make_jaxpr(loss)(params, x))) == on
    got[on] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  assert_close(got[True], got[False], 2e-6)


def test_shapes_the_kernels_decline_keep_the_taps(monkeypatch):
  assert conv_kernel.supported(64, 48, 4) == (64, 16) and conv_kernel.supported(96, 256, 4) == (32, 64)
  assert conv_kernel.supported(64, 96, 4) == (64, 32)  # 64 channels first, then 128, 32, 16
  assert conv_kernel.supported(40, 64, 4) is None and conv_kernel.supported(64, 40, 4) is None
  with pytest.raises(ValueError, match="T a multiple of one of"):
    conv_kernel.short_conv(jnp.zeros((1, 40, 64)), jnp.zeros((1, 3, 64)), jnp.zeros((4, 64)))
  with pytest.raises(ValueError, match=r"state must be \[B, W-1, C\]"):
    conv_kernel.short_conv(jnp.zeros((1, 64, 64)), jnp.zeros((1, 2, 64)), jnp.zeros((4, 64)))
  monkeypatch.setattr(conv_mod, "CONV_KERNEL", True)
  conv = ShortConv(64, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 40, 64))  # T = 40: the taps, whole and as parts
  y, s = conv(x, activation="silu")
  (y1, y2), s2 = conv((x[..., :16], x[..., 16:]), activation="silu")
  np.testing.assert_array_equal(jnp.concatenate([y1, y2], -1), y)
  np.testing.assert_array_equal(s2, s)
  assert "gdn_short_conv" not in str(jax.make_jaxpr(lambda x: conv(x)[0])(x))
  with pytest.raises(ValueError, match="parts must be"):
    conv((x[..., :16], x[..., :16]))


@pytest.mark.gpu
@pytest.mark.full_optimizations
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("B,T,C,segments,fused", [(4, 512, 1536, False, False), (2, 256, 384, True, False),
                                                 (4, 512, 1536, False, True)])
def test_the_compiled_kernels_match_the_taps_on_a_gpu(monkeypatch, dtype, tol, B, T, C, segments, fused):
  """The Triton kernels as the card compiles them (the language-model grid's shape, and segments; the backward
  as two kernels or one), against the taps in float32 (bfloat16: the taps sum in bfloat16, the kernels in
  float32)."""
  monkeypatch.setattr(conv_kernel, "FUSED_BWD", fused)
  W = 4
  k = jax.random.split(jax.random.key(0), 5)
  x, state = jax.random.normal(k[0], (B, T, C), dtype), jax.random.normal(k[1], (B, W - 1, C), dtype)
  w = (jax.random.normal(k[2], (W, C)) * 0.5).astype(dtype)
  keep = jax.random.uniform(k[3], (B, T, W)) > 0.3 if segments else None
  dy = jax.random.normal(k[4], (B, T, C), jnp.float32)
  loss = lambda fn: lambda x, s, w: jnp.sum(fn(x, s, w, None, keep, "silu").astype(jnp.float32) * dy)
  got = jax.jit(jax.value_and_grad(loss(conv_kernel.short_conv), argnums=(0, 1, 2)))(x, state, w)
  f32 = lambda a: a.astype(jnp.float32)
  want = jax.jit(jax.value_and_grad(loss(lambda x, s, w, *a: _taps(f32(x), f32(s), f32(w), *a)),
                                    argnums=(0, 1, 2)))(x, state, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert np.max(np.abs(g - r)) <= tol * max(1.0, np.max(np.abs(r)))
