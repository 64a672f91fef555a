"""`gated_delta_rule(..., g_lower_bound=lb)`: the rule on max(g, lb), and for a per-key-channel decay the chunk-local
pair products as matmuls through each 16-step sub-chunk (`intra_chunk._pair_channel_bounded`). Outputs and
gradients against the float64 recurrence, at the bound itself (the largest exponents the factorisation makes),
beside the exact form; the clamp; the argument's checks; and that the bounded stage builds no pairwise decays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import intra_chunk
from test_ops import assert_close, bfloat16_inputs, kda_grad_shapes, make_inputs, oracle, rel, run

pytestmark = pytest.mark.usefixtures("fast_compile")

LB = intra_chunk.MIN_G_LOWER_BOUND  # -5


def _bounded_inputs(seed, B, T, H, HV, K, V, *, beta_kind="head", segments=False, dtype=np.float32):
  """Per-key-channel g in [LB, 0]: a third of the entries exactly at the bound (a 16-step sub-chunk spans -80,
  e^80 in the factors), a third near 0 (decays within 1e-3 of 1), the rest uniform."""
  x = make_inputs(seed, B, T, H, HV, K, V, "channel", beta_kind, segments=segments, dtype=dtype)
  rng = np.random.default_rng(seed + 100)
  pick = rng.integers(0, 3, x["g"].shape)
  shape = x["g"].shape
  g = np.where(pick == 0, LB, np.where(pick == 1, -rng.uniform(0, 1e-3, shape), rng.uniform(LB, 0, shape)))
  x["g"] = g.astype(dtype)
  return x


@pytest.mark.parametrize("method", ["chunk", "associative"])
@pytest.mark.parametrize("shape", [(2, 70, 1, 2, 8, 5, 64), (1, 40, 2, 2, 9, 4, 16), (1, 21, 1, 1, 6, 3, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_oracle(method, shape):
  """Four sub-chunks (C 64), one (C 16) and one shorter than 16 (C 8); T not a multiple of C; grouped value
  heads, segments and an initial state."""
  B, T, H, HV, K, V, C = shape
  x = _bounded_inputs(1, B, T, H, HV, K, V, segments=True)
  got = run(method, x, chunk_size=C, g_lower_bound=LB)
  assert_close(got, oracle(x), 2e-5, f"{method} {shape}")
  exact = run(method, x, chunk_size=C)
  assert rel(got[0], exact[0]) < 2e-5


def test_local_groups():
  """The chunk-local backward over groups of chunks (`local_groups`) takes the bounded form too."""
  x = _bounded_inputs(9, 2, 70, 1, 2, 8, 5)
  assert_close(run("chunk", x, chunk_size=16, g_lower_bound=LB, local_groups=3), oracle(x), 2e-5)


def test_every_step_at_the_bound_and_no_beta():
  """g = LB everywhere (every sub-chunk spans exactly -80) with per-value-channel, per-head and no beta. g's
  gradient is then tiny (a decay of e^-5 a step: its norm about 1e-3 of q's), and a pair inside a sub-chunk
  reaches it from both factors with opposite signs, so its error is float32 rounding at the other gradients'
  scale: within 2e-5 of dq's norm (1e-3 or less of its own), where the exact form has 1e-7 of its own."""
  for beta_kind in ("channel", "head", "none"):
    x = make_inputs(2, 1, 64, 1, 1, 8, 4, "channel", beta_kind)
    x["g"] = np.full_like(x["g"], LB)
    got, want = run("chunk", x, chunk_size=64, g_lower_bound=LB), oracle(x)
    drop_g = lambda r: (r[0], r[1], {n: v for n, v in r[2].items() if n != "g"})
    assert_close(drop_g(got), drop_g(want), 2e-5, beta_kind)
    err = np.linalg.norm(got[2]["g"] - want[2]["g"])
    assert err < 2e-5 * np.linalg.norm(want[2]["q"]) and err < 1e-3 * np.linalg.norm(want[2]["g"]), beta_kind


def test_pallas_method():
  x = _bounded_inputs(3, 1, 70, 1, 2, 8, 8)
  assert_close(run("pallas", x, chunk_size=32, g_lower_bound=LB), oracle(x), 2e-5)


@pytest.mark.parametrize("lowp_dots", [False, True])
def test_bfloat16_inputs(monkeypatch, lowp_dots):
  """bfloat16 q, k, v, beta and g, with the dots' operands in float32 or (BOUNDED_LOWP_DOTS) in bfloat16."""
  monkeypatch.setattr(intra_chunk, "BOUNDED_LOWP_DOTS", lowp_dots)
  x_bf, x_ref = bfloat16_inputs(_bounded_inputs(4, 2, 80, 2, 2, 16, 16))
  got = run("chunk", x_bf, chunk_size=64, g_lower_bound=LB, switches=(("BOUNDED_LOWP_DOTS", lowp_dots),))
  assert_close(got, oracle(x_ref), 2e-2)


def test_clamps_g_below_the_bound():
  """g below the bound (-30, -1e4) is computed as the bound, with a zero gradient there: the same as the exact
  form on max(g, lb)."""
  x = _bounded_inputs(5, 1, 50, 1, 1, 8, 4)
  low = np.random.default_rng(0).uniform(size=x["g"].shape) < 0.2
  x["g"] = np.where(low, np.where(np.arange(x["g"].size).reshape(x["g"].shape) % 2, -30.0, -1e4), x["g"])
  x["g"] = x["g"].astype(np.float32)
  got = run("chunk", x, chunk_size=16, g_lower_bound=-2.5)
  clamped = dict(x, g=np.maximum(x["g"], -2.5).astype(np.float32))
  want = oracle(clamped)
  assert_close((got[0], got[1], {n: v for n, v in got[2].items() if n != "g"}),
               (want[0], want[1], {n: v for n, v in want[2].items() if n != "g"}), 2e-5)
  below = x["g"] < -2.5
  assert np.all(got[2]["g"][below] == 0)
  assert rel(got[2]["g"][~below], want[2]["g"][~below]) < 2e-5


def test_no_pairwise_decays_in_the_bounded_stage(monkeypatch):
  """The exact form by pairwise decays builds [.., 16, 16, K] of them; the bounded one has no array with a
  16 x 16 x K tail, forward or backward."""
  monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_DYADIC", False)
  x = _bounded_inputs(6, 1, 64, 1, 1, 128, 8)

  def tails(bound):
    return {s for s in kda_grad_shapes(x, g_lower_bound=bound) if s[-3:] == (16, 16, 128)}

  assert tails(None)
  assert not tails(LB)


def test_a_chunk_that_does_not_split_takes_the_exact_form():
  """C = 24 has no 16-step sub-chunks: the exact form, still correct at the bound."""
  x = _bounded_inputs(7, 1, 48, 1, 1, 8, 4)
  assert not intra_chunk.bounded_ok(24) and intra_chunk.bounded_ok(8) and intra_chunk.bounded_ok(64)
  assert_close(run("chunk", x, chunk_size=24, g_lower_bound=LB), oracle(x), 2e-5)


@pytest.mark.parametrize("bound, g, err, match", [
    (-6.0, True, ValueError, r"g_lower_bound must be in \[-5, 0\)"),
    (0.0, True, ValueError, r"g_lower_bound must be in \[-5, 0\)"),
    (0.5, True, ValueError, r"g_lower_bound must be in"),
    (True, True, TypeError, "g_lower_bound must be None or a float"),
    ("x", True, TypeError, "g_lower_bound must be None or a float"),
    (-1.0, False, ValueError, "g is None"),
])
def test_bad_bound_raises(bound, g, err, match):
  x = make_inputs(8, 1, 8, 1, 1, 4, 4, "channel", "head")
  with pytest.raises(err, match=match):
    ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"] if g else None, x["beta"], g_lower_bound=bound)


def test_an_array_bound_is_refused():
  x = make_inputs(8, 1, 8, 1, 1, 4, 4, "channel", "head")
  with pytest.raises(TypeError, match="not an array"):
    ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], g_lower_bound=jnp.asarray(-1.0))


# The layer: RecurrentConfig.gate_lower_bound, fla's bounded KDA gate.


def test_kda_layer_with_a_bounded_gate():
  """g = LB sigmoid(exp(A_log) (a + dt_bias)) lies in (LB, 0); the chunked op (told the bound) gives the token scan's
  output and gradients; per-head decay takes the bound too."""
  import dataclasses
  from flax import nnx
  from gdn.config import recurrent_preset
  from gdn.layers.recurrent import RecurrentMixer

  D = 32
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 40, D)), jnp.float32)
  for preset in ("kda", "gated_deltanet"):
    cfg = recurrent_preset(preset, num_heads=2, head_dim=8, decay_low_rank=4, gate_lower_bound=-3.0, chunk_size=16,
                           method="chunk")
    layer = RecurrentMixer(cfg, D, rngs=nnx.Rngs(0))
    from gdn.layers.recurrent import X_PROJECTIONS, project
    g = layer.log_decay(project(layer, X_PROJECTIONS, x), 2, 40)
    assert g.shape[-1] == (8 if preset == "kda" else 2) and float(g.min()) > -3.0 and float(g.max()) < 0.0
    assert np.all(np.asarray(layer.A_log[...]) == 0.0)  # A = 1 at init, as fla's safe_gate layer
    scan = RecurrentMixer(dataclasses.replace(cfg, method="recurrent"), D, rngs=nnx.Rngs(0))

    @nnx.jit
    def loss_and_grad(m):
      return nnx.value_and_grad(lambda m: (m(x)[0] ** 2).sum())(m)

    (l1, g1), (l2, g2) = loss_and_grad(layer), loss_and_grad(scan)
    assert abs(float(l1) - float(l2)) < 1e-4 * abs(float(l2))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      assert rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-4


@pytest.mark.parametrize("kw, match", [
    (dict(decay="channel", gate_lower_bound=-6.0), r"gate_lower_bound must be in \[-5, 0\)"),
    (dict(decay="channel", gate_lower_bound=0.0), r"gate_lower_bound must be in"),
    (dict(decay="none", beta="head", gate_lower_bound=-1.0), "decay='none'"),
])
def test_config_refuses_a_bad_gate_lower_bound(kw, match):
  from gdn.config import RecurrentConfig
  with pytest.raises(ValueError, match=match):
    RecurrentConfig(**kw)


def test_accuracy_table_script():
  """`experiments.kda_local_accuracy`: every float32 row of its table, within the oracle tolerances above; the
  exact forms (pairwise and dyadic) at float32 rounding, strong decays included. (Its bfloat16 rows, every form
  against the oracle, are `test_bfloat16_inputs` here and in tests/test_kda_dyadic.py.)"""
  from experiments import kda_local_accuracy

  rows = kda_local_accuracy.main(["--dtypes", "float32"])
  assert len(rows) == 11 and not any(r["inputs"].startswith("bfloat16") for r in rows)
  for r in rows:
    tol = 2e-2 if r["inputs"].startswith("bfloat16") else 2e-5
    assert all(r[c] < tol for c in ("o", "dq", "dk", "dv", "dbeta", "dinitial_state")), r
    assert r["dg"] < (1e-3 if "-5 everywhere" in r["inputs"] and "bound" in r["form"] else tol), r
    if r["form"].startswith("exact") and not r["inputs"].startswith("bfloat16"):
      assert max(r[c] for c in r if c.startswith("d") or c == "o") < 1e-6, r
