"""`chunk.SCALAR_GRAD_BARRIER` and `chunk.TENSOR_GRAD_BARRIER`: the gradients of the per-head g and beta, and those of
q, k, v and the per-channel g and beta, leave the chunk layout through an optimization barrier. The op's outputs
and gradients against the float64 oracle with it on, equal to it off, and the barriers present in the VJP only
when on (so the check can fail)."""

import jax
import pytest

from gdn.ops import chunk
import test_ops
from test_ops import assert_close, make_inputs, oracle

pytestmark = pytest.mark.usefixtures("fast_compile")


def _barriers(jaxpr):
  """How many optimization barriers the jaxpr and its sub-jaxprs hold."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "optimization_barrier"
    for p in eqn.params.values():
      inner = getattr(p, "jaxpr", None)
      if inner is not None:
        n += _barriers(inner if hasattr(inner, "eqns") else inner.jaxpr)
  return n


# (switch, per-head or per-channel g and beta): the scalars' barrier with per-head ones, the tensors' with
# per-channel ones (every input 4-D)
SETTINGS = [("SCALAR_GRAD_BARRIER", "head"), ("TENSOR_GRAD_BARRIER", "channel")]


@pytest.mark.parametrize("switch, kind", SETTINGS)
@pytest.mark.parametrize("method", ["chunk", "pallas"])
def test_values_and_gradients_are_unchanged(monkeypatch, method, switch, kind):
  """Grouped value heads, packed segments, an initial state, T not a multiple of C."""
  x = make_inputs(71, 2, 45, 1, 2, 16, 16, kind, kind, segments=True)
  want = oracle(x, chunk_size=16)
  got = {}
  for on in (False, True):
    monkeypatch.setattr(chunk, switch, on)
    got[on] = test_ops.run(method, x, chunk_size=16, switches=((switch, on),))
  assert_close(got[True], want, 1e-5, f"{method} float32, {switch} on")
  assert_close(got[True], got[False], 1e-6, f"{method} on vs off")


# (switch, g kind, barriers in the VJP when on): one for each per-position scalar input (beta; g when per head);
# one for each [B, T, HV, K] input (q, k, v; g when per channel)
COUNTS = [("SCALAR_GRAD_BARRIER", "head", 2), ("SCALAR_GRAD_BARRIER", "channel", 1),
          ("TENSOR_GRAD_BARRIER", "channel", 4), ("TENSOR_GRAD_BARRIER", "head", 3)]


@pytest.mark.parametrize("switch, g_kind, n", COUNTS)
def test_the_barriers_are_in_the_vjp_only_when_on(monkeypatch, switch, g_kind, n):
  """Per-head beta; none in the forward."""
  x = make_inputs(72, 1, 32, 1, 1, 16, 16, g_kind, "head")
  diff, _, co = test_ops.vjp_inputs(x)
  counts = {}
  for on in (False, True):
    monkeypatch.setattr(chunk, switch, on)

    def op(d):
      return test_ops.ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], method="chunk",
                                           chunk_size=16)[0]

    def f(diff):  # defined per setting: make_jaxpr caches traces by function identity
      o, vjp = jax.vjp(op, diff)
      return vjp(co[0].astype(o.dtype))

    counts[on] = (_barriers(jax.make_jaxpr(f)(diff).jaxpr), _barriers(jax.make_jaxpr(op)(diff).jaxpr))
  assert counts == {False: (0, 0), True: (n, 0)}, counts
