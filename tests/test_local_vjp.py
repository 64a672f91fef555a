"""`intra_chunk.LOCAL_VJP`: the chunk-local stage's hand-derived VJP (per-head decay and beta) against JAX's
autodiff of the same forward, field by field, and the whole op through it against the float64 oracle.

Shapes: L chunks, C chunk size, K key dim, V value dim.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.bench.residuals import saved_residuals
from gdn.ops import intra_chunk, pallas_chunk
import test_ops
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, rel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

F32, BF16 = (jnp.float32, jax.lax.Precision.HIGHEST), (jnp.bfloat16, jax.lax.Precision.DEFAULT)


def local_inputs(seed, L, C, K, V, dtype, *, g_min=None, segments=False):
  """q (scaled), k (unit rows), v [L, C, ...] in `dtype`; g, beta [L, C] float32 (beta in [0, 2]; with g_min,
  a fifth of the log-decays set to it); masks as `chunk._segment_masks` makes them, or None."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(L, C, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q, v = rng.normal(size=(L, C, K)) * K ** -0.5, rng.normal(size=(L, C, V))
  g = np.log(rng.uniform(0.5, 1.0, (L, C)))
  if g_min is not None:
    g = np.where(rng.uniform(size=(L, C)) < 0.2, g_min, g)
  beta = rng.uniform(0.0, 2.0, (L, C))
  masks = None
  if segments:
    reset = rng.uniform(size=(L, C)) < 0.15
    seg = np.cumsum(reset, axis=-1)
    entering = seg[:, :1] - reset[:, :1]
    masks = tuple(map(jnp.asarray, (seg[:, :, None] == seg[:, None, :], seg == entering, seg == seg[:, -1:],
                                    seg[:, -1:] == entering)))
  arrays = [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(x, jnp.float32) for x in (g, beta)]
  return arrays, masks


def local_vjp(monkeypatch, own, arrays, masks, prec, seed=3, lowp=False):
  """(outputs, input cotangents) of `local` for random cotangents of all eight outputs, with LOCAL_VJP = own and
  LOWP_SOLVE = lowp (here off by default: the 16-bit solve rounds at different points in the two VJPs, so they
  agree only to bfloat16 rounding; tests/test_lowp_solve.py holds that setting)."""
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", own)
  monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", lowp)
  fn = lambda *xs: intra_chunk.local(*xs, masks, beta_kind="head", prec=prec)
  rng = np.random.default_rng(seed)
  ct = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), jax.eval_shape(fn, *arrays))

  @jax.jit  # one program, traced afresh under the switches above (not a few hundred eager dispatches)
  def run(arrays, ct):
    out, vjp = jax.vjp(fn, *arrays)
    return out, vjp(ct)

  return run(arrays, ct)


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("K, V, segments", [(16, 32, False), (32, 16, True)])
@pytest.mark.parametrize("g_min", [None, -1e4], ids=["realistic", "g_min=-1e4"])
@pytest.mark.parametrize("dtype, prec", [F32, BF16], ids=["float32", "bfloat16"])
def test_vjp_equals_autodiff(monkeypatch, C, K, V, segments, g_min, dtype, prec):
  """Same outputs; every input cotangent finite and equal to autodiff's to float32 rounding (the 16-bit dq, dk, dv
  of bfloat16 inputs: as the op's bfloat16 tests)."""
  arrays, masks = local_inputs(C + K, 5, C, K, V, dtype, g_min=g_min, segments=segments)
  out, got = local_vjp(monkeypatch, True, arrays, masks, prec)
  out_ref, want = local_vjp(monkeypatch, False, arrays, masks, prec)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out_ref)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  for name, a, b in zip(["q", "k", "v", "g", "beta"], got, want):
    assert a.dtype == b.dtype, name
    tol = 1e-6 if a.dtype == jnp.float32 else 2e-2
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), f"d{name} not finite"
    assert rel(a, b) < tol, f"d{name}: {rel(a, b):.2e}"


@pytest.mark.parametrize("own", [True, False])
def test_saves_only_inputs_and_inverse(monkeypatch, own):
  """With LOCAL_VJP the stage is a custom_vjp call, and the backward keeps the inputs and the float32 inverse
  [L, C, C], nothing else. Autodiff (with the inverse's autodiff too) has no custom_vjp call and keeps the
  intermediates. (With LOWP_SOLVE, the default, that inverse is kept in the inputs' bfloat16; off here.)"""
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", own)
  monkeypatch.setattr(intra_chunk, "INVERSE_VJP", False)
  monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", False)
  arrays, masks = local_inputs(0, 3, 32, 16, 16, jnp.bfloat16, segments=True)
  fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=jax.lax.Precision.DEFAULT)
  eqns = jax.make_jaxpr(fn)(*arrays, *masks).eqns
  assert any(e.primitive.name == "custom_vjp_call" for e in eqns) == own
  kept = [r for r in saved_residuals(fn, *arrays, *masks) if r.what != "argument"]  # the masks are arguments
  inverse = [(r.shape, r.dtype) for r in kept] == [((3, 32, 32), "float32")]
  assert inverse == own, [(r.shape, r.dtype, r.what) for r in kept]


def run(method, x, switches=(), **kw):
  """test_ops.run with LOCAL_VJP on (set by the caller) and the switches as the jit cache's key."""
  return test_ops.run(method, x, chunk_size=8, switches=(("LOCAL_VJP", True),) + switches, **kw)


@pytest.mark.parametrize("method", ["chunk", "pallas"])
@pytest.mark.parametrize("segments", [False, True])
def test_op_matches_oracle(monkeypatch, method, segments):
  """The op (grouped value heads, odd K and V, T not a multiple of C, an initial state) equals the float64 oracle
  and the autodiff path, outputs and all gradients; the grouped backward (local_groups=3) too."""
  x = make_inputs(41, 2, 35, 2, 4, 5, 3, "head", "head", segments=segments)
  want, default = oracle(x), test_ops.run(method, x, chunk_size=8)
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", True)
  for groups in (None, 3):
    got = run(method, x, local_groups=groups)
    assert_close(got, want, 1e-5, f"{method} LOCAL_VJP local_groups={groups} vs oracle")
    assert_close(got, default, 1e-6, f"{method} LOCAL_VJP local_groups={groups} vs autodiff")


def test_pallas_fused_local(monkeypatch):
  """The fused chunk-local kernel (interpreted on CPU): differentiated, `pallas_local` runs `local`'s VJP."""
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", True)
  x = make_inputs(42, 1, 35, 1, 2, 5, 7, "head", "head")
  assert_close(run("pallas", x, (("FUSED_LOCAL", True),)), oracle(x), 1e-5, "pallas fused local, LOCAL_VJP")


@pytest.mark.parametrize("method", ["chunk", "pallas"])
def test_op_total_forgetting_and_bfloat16(monkeypatch, method):
  """g = -1e4 (every decay underflows to 0) in float32; bfloat16 inputs with packed segments."""
  monkeypatch.setattr(intra_chunk, "LOCAL_VJP", True)
  x = make_inputs(43, 1, 40, 1, 2, 8, 8, "head", "head", beta_max=1.0)
  x["g"] = np.full_like(x["g"], -1e4)
  assert_close(run(method, x), oracle(x, chunk_size=8), 1e-5, f"{method} g = -1e4")
  x_bf, x_ref = bfloat16_inputs(make_inputs(44, 2, 40, 2, 2, 16, 16, "head", "head", segments=True))
  assert_close(run(method, x_bf), oracle(x_ref, chunk_size=8), 2e-2, f"bf16 {method}")
