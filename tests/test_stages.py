"""gdn.ops.stages: prepare -> state pass -> finish, composed by hand, is the gated delta rule (float64 oracle)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.ops import gated_delta_rule, stages
from reference import gated_delta_rule_ref
from test_ops import make_inputs, rel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.mark.parametrize("method", stages.STATE_PASSES)
def test_composed_stages_are_the_op(method):
  # Grouped value heads, an odd length (padding), packed segments and an initial state, in one case.
  x = make_inputs(3, B=2, T=37, H=1, HV=2, K=8, V=6, g_kind="head", beta_kind="head", segments=True)
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  seg, S0 = jnp.asarray(x["segment_ids"]), jnp.asarray(x["initial_state"])

  @jax.jit  # one program, as a user composing the stages would run them
  def staged(args, seg, S0):
    p = stages.prepare(*args, segment_ids=seg, chunk_size=16)
    S_T, S_in, U = stages.state_pass(p, S0, method=method)
    return stages.finish(p, S_in, U), S_T, S_in, U

  o, S_T, S_in, U = staged(args, seg, S0)
  assert S_in.shape == (2, 2, 3, 8, 6) and U.shape == (2, 2, 3, 16, 6)
  o_ref, S_ref = gated_delta_rule_ref(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
                                      segment_ids=x["segment_ids"])
  assert rel(np.asarray(o, np.float64), o_ref) < 1e-5
  assert rel(np.asarray(S_T, np.float64), S_ref) < 1e-5
  # The stages are what the op runs: equal to the method, not only close to the oracle.
  want = {"scan": "chunk", "associative": "associative", "pallas": "pallas"}[method]
  o_op, S_op = gated_delta_rule(*args, initial_state=S0, segment_ids=seg, method=want, chunk_size=16)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_op), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(S_T), np.asarray(S_op), rtol=1e-6, atol=1e-6)


def test_gradients_flow_through_the_stages():
  x = make_inputs(4, B=1, T=20, H=2, HV=2, K=4, V=4, g_kind="channel", beta_kind="channel", init=False)
  args = {n: jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")}

  def loss(a, run):
    return jnp.sum(run(a) ** 2)

  def staged(a):
    p = stages.prepare(**a, chunk_size=8)
    return stages.finish(p, *stages.state_pass(p)[1:])

  got = jax.jit(jax.grad(lambda a: loss(a, staged)))(args)
  want = jax.jit(jax.grad(lambda a: loss(a, lambda a: gated_delta_rule(**a, method="recurrent")[0])))(args)
  for n in args:
    assert rel(np.asarray(got[n]), np.asarray(want[n])) < 1e-4, n


def test_channel_beta_state_passes():
  """Per-value-channel beta: the Pallas state pass (its kernel's own solve) equals the scan's."""
  x = make_inputs(6, B=1, T=37, H=1, HV=2, K=8, V=6, g_kind="head", beta_kind="channel", segments=True)
  p = stages.prepare(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                     segment_ids=jnp.asarray(x["segment_ids"]), chunk_size=16)
  S0 = jnp.asarray(x["initial_state"])
  for got, want in zip(stages.state_pass(p, S0, method="pallas"), stages.state_pass(p, S0, method="scan")):
    assert rel(np.asarray(got), np.asarray(want)) < 1e-5


def test_bad_state_pass_is_named():
  x = make_inputs(5, B=1, T=8, H=1, HV=1, K=4, V=4, g_kind="head", beta_kind="channel", init=False)
  p = stages.prepare(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), chunk_size=4)
  with pytest.raises(ValueError, match="per-value-channel beta"):
    stages.state_pass(p, method="associative")
  with pytest.raises(ValueError, match="method must be one of"):
    stages.state_pass(p, method="parallel")
  with pytest.raises(ValueError, match="q must have rank 4"):
    stages.prepare(jnp.zeros((2, 3)), p.local.k_end, p.local.U)
