"""The exact per-key-channel (KDA) chunk-local stage by dyadic anchors (`intra_chunk._pair_channel_dyadic`,
`intra_chunk.CHANNEL_PAIR_DYADIC`): its pair products against the pairwise-decay form in float64 at every power-of-two
chunk, under decays far stronger than any bound; the op against the float64 recurrence through every chunked method;
and that it builds no [c, c, K] pairwise decays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import intra_chunk
from test_ops import assert_close, bfloat16_inputs, kda_grad_shapes, make_inputs, oracle, run
from test_pallas import equations

pytestmark = pytest.mark.usefixtures("fast_compile")

ON = (("CHANNEL_PAIR_DYADIC", True),)


def _strong(x, seed, low=-30.0):
  """g drawn with a third of its entries in [low, 0] (decays down to e^-30 a step), a third within 1e-3 of 0."""
  rng = np.random.default_rng(seed)
  shape = x["g"].shape
  pick = rng.integers(0, 3, shape)
  g = np.where(pick == 0, rng.uniform(low, 0, shape), np.where(pick == 1, -rng.uniform(0, 1e-3, shape), x["g"]))
  return {**x, "g": g.astype(x["g"].dtype)}


@pytest.mark.parametrize("C", [2, 8, 32, 64])
def test_pair_products_match_the_pairwise_form(C):
  """A (strictly lower) and P (lower, diagonal included) equal `_pair_channel`'s to float64 rounding, and are zero
  elsewhere; log-decays down to -60 a step (a 64-step chunk spans thousands: no e^{+x} anywhere)."""
  rng = np.random.default_rng(C)
  L, K = 3, 8
  with jax.enable_x64(True):
    q, k = (jnp.asarray(rng.normal(size=(2, L, C, K))) for _ in range(2))
    g = -jnp.asarray(rng.uniform(0, 60, (2, L, C, K)) * (rng.uniform(size=(2, L, C, K)) < 0.5))
    dot = intra_chunk._dot(jax.lax.Precision.HIGHEST)
    (A0, P0), (A1, P1) = jax.jit(lambda q, k, g: (intra_chunk._pair_channel(q, k, g, dot),
                                                  intra_chunk._pair_channel_dyadic(q, k, g, dot)))(q, k, g)
    strict, incl = np.tril(np.ones((C, C), bool), -1), np.tril(np.ones((C, C), bool))
    np.testing.assert_allclose(np.where(strict, A1, 0), np.where(strict, A0, 0), atol=1e-12)
    np.testing.assert_allclose(np.where(incl, P1, 0), np.where(incl, P0, 0), atol=1e-12)
    assert np.all(np.asarray(A1)[..., ~strict] == 0) and np.all(np.asarray(P1)[..., ~incl] == 0)


@pytest.mark.parametrize("method, beta_kind", [("chunk", "head"), ("chunk", "channel"), ("chunk", "none"),
                                               ("associative", "head"), ("associative", "none")])
@pytest.mark.parametrize("shape", [(2, 70, 1, 2, 8, 5, 64), (1, 40, 2, 2, 9, 4, 16), (1, 21, 1, 1, 6, 3, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_oracle(method, beta_kind, shape):
  """C 64, 16 and 2; T not a multiple of C; grouped value heads, segments, an initial state; strong decays."""
  B, T, H, HV, K, V, C = shape
  x = _strong(make_inputs(1, B, T, H, HV, K, V, "channel", beta_kind, segments=True, beta_max=1.0), 11)
  assert_close(run(method, x, chunk_size=C, switches=ON), oracle(x), 2e-5, f"{method} {beta_kind} {shape}")


def test_pallas_method_and_local_groups():
  x = _strong(make_inputs(3, 1, 70, 1, 2, 8, 8, "channel", "head"), 12)
  want = oracle(x)
  assert_close(run("pallas", x, chunk_size=32, switches=ON), want, 2e-5, "pallas")
  assert_close(run("chunk", x, chunk_size=16, local_groups=3, switches=ON), want, 2e-5, "local_groups")


def test_the_pairwise_form_stays_exact(monkeypatch):
  """With the switch off the stage takes the pairwise decays, as before."""
  monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_DYADIC", False)
  x = _strong(make_inputs(4, 1, 70, 1, 1, 8, 4, "channel", "head"), 13)
  assert_close(run("chunk", x, chunk_size=64, switches=(("CHANNEL_PAIR_DYADIC", False),)), oracle(x), 2e-5)


def test_a_chunk_of_no_power_of_two_takes_the_pairwise_form():
  assert [intra_chunk.dyadic_ok(C) for C in (1, 2, 24, 48, 64)] == [False, True, False, False, True]
  x = _strong(make_inputs(5, 1, 48, 1, 1, 8, 4, "channel", "head"), 14)
  assert_close(run("chunk", x, chunk_size=24, switches=ON), oracle(x), 2e-5)


@pytest.mark.parametrize("lowp_dots", [False, True])
def test_bfloat16_inputs(monkeypatch, lowp_dots):
  """bfloat16 q, k, v, beta and g, the level dots' operands in float32 or (DYADIC_LOWP_DOTS) in bfloat16."""
  monkeypatch.setattr(intra_chunk, "DYADIC_LOWP_DOTS", lowp_dots)
  x_bf, x_ref = bfloat16_inputs(make_inputs(6, 2, 80, 2, 2, 16, 16, "channel", "head", beta_max=1.0))
  got = run("chunk", x_bf, chunk_size=64, switches=ON + (("DYADIC_LOWP_DOTS", lowp_dots),))
  assert_close(got, oracle(x_ref), 2e-2)


def test_lowp_dots_take_16_bit_operands(monkeypatch):
  """With DYADIC_LOWP_DOTS the level dots of bfloat16 inputs read bfloat16 operands (and float32 ones without);
  float32 inputs keep float32 operands either way."""
  rng = np.random.default_rng(15)
  q, k = (rng.normal(size=(2, 64, 8)) for _ in range(2))
  g = -rng.uniform(0, 1, (2, 64, 8))

  def operand_dtypes(dtype, lowp):
    monkeypatch.setattr(intra_chunk, "DYADIC_LOWP_DOTS", lowp)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(g, jnp.float32))
    f = lambda *a: intra_chunk._pair_channel_dyadic(*a, intra_chunk._dot(jax.lax.Precision.DEFAULT))
    jaxpr = jax.make_jaxpr(f)(*args)
    # the level dots: [2, C/2s, s, K] x [2, C/2s, s, K], both operands with four axes (the span sums' dots take a
    # 2-D 0/1 mask, the diagonal's q . k has three)
    return [{str(v.aval.dtype) for v in e.invars} for e in equations(jaxpr, "dot_general")
            if min(v.aval.ndim for v in e.invars) == 4]

  assert len(operand_dtypes(jnp.bfloat16, True)) == 2 * 6  # A's and P's at each of log2(64) levels
  assert all(d == {"bfloat16"} for d in operand_dtypes(jnp.bfloat16, True))
  assert all("float32" in d for d in operand_dtypes(jnp.bfloat16, False))  # the decayed columns at least
  assert all(d == {"float32"} for d in operand_dtypes(jnp.float32, True))


def test_no_pairwise_decays(monkeypatch):
  """No array with a [c, c, K] tail (c >= 4; the levels' [.., 2, s, K] halves have s = 2 once), forward or
  backward, where the pairwise form has [.., 16, 16, K]."""
  x = make_inputs(7, 1, 64, 1, 1, 128, 8, "channel", "head")

  def tails(dyadic):
    monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_DYADIC", dyadic)
    return {s for s in kda_grad_shapes(x) if len(s) >= 3 and s[-1] == 128 and s[-2] == s[-3] >= 4}

  assert (16, 16, 128) in {s[-3:] for s in tails(False)}
  assert not tails(True)


@pytest.mark.parametrize("case", ["total_forgetting", "mixed"])
def test_total_forgetting(case):
  """The contract's g down to -1e4 with a per-key-channel decay: everywhere, and on a tenth of the entries beside
  weak decays (-0.01), where differences of chunk-long sums would lose every digit."""
  x = make_inputs(8, 1, 70, 1, 2, 8, 8, "channel", "head", beta_max=1.0)
  rng = np.random.default_rng(1)
  g = np.full_like(x["g"], -1e4) if case == "total_forgetting" else np.where(
      rng.uniform(size=x["g"].shape) < 0.1, -1e4, -0.01)
  x["g"] = g.astype(np.float32)
  assert_close(run("chunk", x, chunk_size=32, switches=ON), oracle(x), 1e-5, case)


def _trivial_cumsums(x):
  """The shapes of the cumulative sums along an axis of length 1 in the traced gradient of a per-key-channel op
  with respect to every input, nested programs included."""
  names = ("q", "k", "v", "g", "beta")

  def loss(*args):
    o, _ = ops.gated_delta_rule(*args, method="chunk")
    return o.sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(5))))(*(jnp.asarray(x[n]) for n in names))
  return [tuple(e.invars[0].aval.shape) for e in equations(jaxpr, "cumsum")
          if e.invars[0].aval.shape[e.params["axis"]] == 1]


def test_no_cumulative_sums_of_single_steps():
  """The first level (pairs of neighbours, whose span sums are empty or one g) takes g directly. As cumulative
  sums over one step, its empty sums were sums of constant zeros, which XLA's GPU compiler folds at compile time
  element by element: 237 s to compile the kda_3to1 model's step on an H200, against 50 s for the pairwise form."""
  x = make_inputs(9, 1, 64, 1, 1, 8, 4, "channel", "head")
  assert _trivial_cumsums(x) == []
