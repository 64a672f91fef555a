"""`intra_chunk.LOWP_SOLVE`: the W/U solve's operands (the right-hand sides and the inverse T) in the 16-bit inputs'
dtype. bfloat16 outputs and gradients against the float64 oracle, float32 inputs untouched, and what the
chunk-local stage's backward keeps.

Shapes: L chunks, C chunk size, K key dim, V value dim.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.bench.residuals import saved_residuals
from gdn.ops import intra_chunk
import test_ops
from test_local_vjp import local_inputs, local_vjp
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, rel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

PREC = jax.lax.Precision.DEFAULT


def run(method, x, on, **kw):
  """test_ops.run with LOWP_SOLVE set (by the caller) to `on`, the switch as the jit cache's key."""
  return test_ops.run(method, x, chunk_size=16, switches=(("LOWP_SOLVE", on),), **kw)


@pytest.mark.parametrize("method", ["chunk", "pallas"])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_bfloat16_matches_oracle(monkeypatch, method, beta_max):
  """bfloat16 inputs (grouped value heads, packed segments, an initial state, T not a multiple of C): outputs, final
  state and every gradient within 1e-2 of the float64 oracle, off and on (both about 5e-3: the bfloat16 pipeline's
  rounding; a wrongly transposed T or right-hand side is off by O(1)), and the switch changes the values."""
  x_bf, x_ref = bfloat16_inputs(make_inputs(51, 2, 72, 1, 2, 32, 32, "head", "head", segments=True,
                                            beta_max=beta_max))
  want = oracle(x_ref, chunk_size=16)
  got = {}
  for on in (False, True):
    monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", on)
    got[on] = run(method, x_bf, on)
    assert_close(got[on], want, 1e-2, f"bf16 {method} LOWP_SOLVE={on}")
  assert rel(got[True][0], got[False][0]) > 0, "LOWP_SOLVE changed nothing"


def test_float32_unchanged(monkeypatch):
  """float32 inputs: the same outputs and gradients, bit for bit, with the switch on and off."""
  x = make_inputs(52, 1, 40, 1, 1, 16, 16, "head", "head", segments=True)
  (o0, S0, g0), (o1, S1, g1) = [(monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", on), run("chunk", x, on))[1]
                                for on in (False, True)]
  np.testing.assert_array_equal(o0, o1)
  np.testing.assert_array_equal(S0, S1)
  for n in g0:
    np.testing.assert_array_equal(g0[n], g1[n], err_msg=f"d{n}")


def kept(fn, arrays, masks):
  """(shape, dtype) of what the VJP of `fn` keeps, the arguments left out."""
  return [(r.shape, r.dtype) for r in saved_residuals(fn, *arrays, *masks) if r.what != "argument"]


@pytest.mark.parametrize("inverse_vjp", [True, False])
def test_residuals_are_16_bit(monkeypatch, inverse_vjp):
  """bfloat16 inputs: off, `local`'s backward keeps a float32 [L, C, K + V] (the right-hand sides); on, the two
  right-hand sides apart, bfloat16 [L, C, K] and [L, C, V], and the inverse it keeps (INVERSE_VJP) is bfloat16, not
  float32. On, no [L, C, K + V] array is made in the forward or the backward (off, the backward sums the padded
  cotangents of W and U into a float32 one)."""
  monkeypatch.setattr(intra_chunk, "INVERSE_VJP", inverse_vjp)
  L, C, K, V = 3, 32, 16, 8
  arrays, masks = local_inputs(1, L, C, K, V, jnp.bfloat16, segments=True)
  fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=PREC)

  def joint(on):  # the [L, C, K + V] arrays in the jaxpr of the forward and its VJP
    def vjp(*xs):
      out, pull = jax.vjp(fn, *xs)
      return pull(out)
    jaxpr = jax.make_jaxpr(vjp)(*arrays, *masks)
    return [str(v.aval) for e in jaxpr.eqns for v in e.outvars if getattr(v.aval, "shape", ()) == (L, C, K + V)]

  res, joints = {}, {}
  for on in (False, True):
    monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", on)
    res[on], joints[on] = kept(fn, arrays, masks), joint(on)
  assert ((L, C, K + V), "float32") in res[False]
  assert not any(shape == (L, C, K + V) for shape, _ in res[True]), res[True]
  assert ((L, C, K), "bfloat16") in res[True] and ((L, C, V), "bfloat16") in res[True], res[True]
  assert "float32[3,32,24]" in joints[False] and joints[True] == [], joints[True]
  if inverse_vjp:
    assert ((L, C, C), "bfloat16") in res[True] and ((L, C, C), "bfloat16") not in res[False]
    assert sum(r == ((L, C, C), "float32") for r in res[True]) < sum(r == ((L, C, C), "float32") for r in res[False])


def test_local_vjp_keeps_16_bit_inverse(monkeypatch):
  """With LOCAL_VJP too: the stage keeps its inputs and the bfloat16 inverse, and its hand-derived gradients equal
  autodiff's of the same forward to bfloat16 rounding."""
  monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", True)
  arrays, masks = local_inputs(2, 3, 32, 16, 8, jnp.bfloat16, segments=True)
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", True)
  fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=PREC)
  assert kept(fn, arrays, masks) == [((3, 32, 32), "bfloat16")]
  _, got = local_vjp(monkeypatch, True, arrays, masks, PREC, lowp=True)
  _, want = local_vjp(monkeypatch, False, arrays, masks, PREC, lowp=True)
  for name, a, b in zip(["q", "k", "v", "g", "beta"], got, want):
    assert a.dtype == b.dtype, name
    assert rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 2e-2, name


def test_inverse_in_16_bit():
  """invert_unit_lower(dtype=bfloat16): the float32 inverse rounded, and its VJP (from the bfloat16 T) float32 and
  within bfloat16 rounding of the float32 one's."""
  rng = np.random.default_rng(0)
  L = jnp.asarray(rng.normal(size=(3, 64, 64)) * 0.1, jnp.float32)
  ct = jnp.asarray(rng.normal(size=(3, 64, 64)), jnp.float32)

  @jax.jit
  def both(L, ct):
    T, vjp = jax.vjp(lambda L: intra_chunk.invert_unit_lower(L, PREC), L)
    T16, vjp16 = jax.vjp(lambda L: intra_chunk.invert_unit_lower(L, PREC, dtype=jnp.bfloat16), L)
    return T, T16, vjp(ct)[0], vjp16(ct.astype(jnp.bfloat16))[0]

  T, T16, dL, dL16 = both(L, ct)
  np.testing.assert_array_equal(np.asarray(T16), np.asarray(T.astype(jnp.bfloat16)))
  assert dL16.dtype == jnp.float32
  assert rel(np.asarray(dL16, np.float64), np.asarray(dL, np.float64)) < 1e-2


def test_products_backward_without_transposes(monkeypatch):
  """On, the VJP of W = T (beta k_dec) and U = T (beta v) forms T^T dW and T^T dU in their own layout (off,
  autodiff forms the joint [L, K + V, C] and transposes it), from the 16-bit cotangent, as autodiff's to bfloat16
  rounding."""
  L, C, K, V = 3, 32, 16, 8
  arrays, masks = local_inputs(4, L, C, K, V, jnp.bfloat16, segments=True)
  fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=PREC)

  def transposed(on):
    def vjp(*xs):  # a new function per setting: make_jaxpr caches traces by function
      out, pull = jax.vjp(fn, *xs)
      return pull(jax.tree.map(jnp.ones_like, out))

    monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", on)
    eqns = jax.make_jaxpr(vjp)(*arrays, *masks).eqns
    return [e.invars[0].aval.shape for e in eqns if e.primitive.name == "transpose"]

  assert (L, K + V, C) in transposed(False)  # off: the joint product's
  assert not {(L, K, C), (L, V, C), (L, K + V, C)} & set(transposed(True))
  T = jnp.asarray(np.tril(np.random.default_rng(0).normal(size=(L, C, C))), jnp.bfloat16)
  R = jnp.asarray(np.random.default_rng(1).normal(size=(L, C, K)), jnp.bfloat16)
  dY = jnp.asarray(np.random.default_rng(2).normal(size=(L, C, K)), jnp.bfloat16)
  got = jax.vjp(lambda T, R: intra_chunk._apply_lowp(PREC, T, R), T, R)[1](dY)
  want = jax.vjp(lambda T, R: intra_chunk.mm("...ti,...ix->...tx", T, R, precision=PREC).astype(R.dtype), T, R)[1](dY)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype == jnp.bfloat16
    assert rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-2


def test_solve_beta_vjp(monkeypatch):
  """SOLVE_BETA_VJP (the W/U products' VJP with beta apart): the stage's outputs bit for bit those without it, its
  cotangents equal autodiff's to bfloat16 rounding (beta's, which it forms as colsum(T * G) rather than
  rowsum((T^T dU) * v), included), fewer bytes kept for the backward; the whole bfloat16 op (packed
  segments, grouped value heads, beta up to 2) within 1e-2 of the float64 oracle."""
  monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", True)
  L, C, K, V = 3, 32, 16, 8
  arrays, masks = local_inputs(4, L, C, K, V, jnp.bfloat16, segments=True)
  fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=PREC)
  got = {}
  for on in (False, True):
    monkeypatch.setattr(intra_chunk, "SOLVE_BETA_VJP", on)
    out, pull = jax.vjp(fn, *arrays, *masks)
    ct = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(5).normal(size=x.shape), x.dtype), out)
    got[on] = out, pull(ct)[:5], kept(fn, arrays, masks)
  for a, b in zip(jax.tree.leaves(got[True][0]), jax.tree.leaves(got[False][0])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  for name, a, b in zip("q k v g beta".split(), got[True][1], got[False][1]):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)) and rel(a, b) < 1e-2, (name, rel(a, b))
  nbytes = lambda res: sum(np.prod(shape) * np.dtype(dt).itemsize for shape, dt in res)
  assert nbytes(got[True][2]) < nbytes(got[False][2]), (got[True][2], got[False][2])
  x_bf, x_ref = bfloat16_inputs(make_inputs(53, 2, 72, 1, 2, 32, 32, "head", "head", segments=True, beta_max=2.0))
  assert_close(test_ops.run("chunk", x_bf, chunk_size=16, switches=(("SOLVE_BETA_VJP", True),)),
               oracle(x_ref, chunk_size=16), 1e-2, "bf16 chunk SOLVE_BETA_VJP")
