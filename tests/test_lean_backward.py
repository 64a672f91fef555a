"""The op's leaner backward: `local_groups` (the chunk-local stage's backward over groups of chunks,
`intra_chunk.grouped`) and `chunk.OUTPUT_VJP` (the chunk scan and the output as one explicit reverse scan). With
either on, outputs and gradients equal the default path's to float32 rounding and match the float64 oracle.

Inputs as test_ops: grouped value heads, odd K and V, T not a multiple of C, an initial state, packed segments.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn import ops
from gdn.bench.residuals import residual_bytes, saved_residuals
from gdn.config import RecurrentConfig, recurrent_preset
from gdn.layers.recurrent import RecurrentMixer
from gdn.ops import chunk
import test_ops
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, rel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def run(method, x, *, local_groups=1, output_vjp=False, chunk_size=8):
  """test_ops.run with local_groups and chunk.OUTPUT_VJP (read at tracing, so it keys the cache)."""
  chunk.OUTPUT_VJP = output_vjp
  try:
    return test_ops.run(method, x, chunk_size=chunk_size, local_groups=local_groups,
                        switches=(("OUTPUT_VJP", output_vjp),))
  finally:
    chunk.OUTPUT_VJP = False


def _check(method, x, settings, tol, chunk_size=8):
  """Each of `settings` (local_groups, output_vjp) against the default path (float32 rounding: tol / 10) and the
  oracle (tol)."""
  default, want = run(method, x, chunk_size=chunk_size), oracle(x)
  assert_close(default, want, tol, f"{method} default")
  for groups, output_vjp in settings:
    got = run(method, x, local_groups=groups, output_vjp=output_vjp, chunk_size=chunk_size)
    what = f"{method} local_groups={groups} output_vjp={output_vjp}"
    assert_close(got, default, tol / 10, f"{what} vs default")
    assert_close(got, want, tol, f"{what} vs oracle")


# (g, beta): Gated DeltaNet, per-key-channel decay (KDA), no decay (DeltaNet), no delta rule, per-channel beta
VARIANTS = [("head", "head"), ("channel", "head"), ("none", "head"), ("head", "none"), ("head", "channel")]


@pytest.mark.parametrize("g_kind, beta_kind", VARIANTS)
def test_chunk_float32(g_kind, beta_kind):
  """B HV N = 2 x 4 x 5 = 40 chunks: 3 groups pad to 42, 40 groups hold one chunk each. OUTPUT_VJP falls back to
  autodiff for per-value-channel beta."""
  x = make_inputs(31, 2, 35, 2, 4, 5, 3, g_kind, beta_kind, segments=True)
  # The grouping's edge cases (one chunk a group, OUTPUT_VJP alone) do not depend on the gates: Gated DeltaNet's.
  edges = [(40, False), (1, True)] if (g_kind, beta_kind) == ("head", "head") else []
  _check("chunk", x, [(3, False), (3, True), *edges], 1e-5)


def test_associative_float32():
  x = make_inputs(38, 2, 35, 2, 4, 5, 3, "channel", "head", segments=True)
  _check("associative", x, [(3, False)], 1e-5)


@pytest.mark.parametrize("g_kind, beta_kind", [("head", "head"), ("channel", "head"), ("head", "channel")])
def test_pallas_float32(g_kind, beta_kind):
  """The Pallas state pass (interpreted on CPU) with the chunk-local backward in 3 groups."""
  x = make_inputs(32, 2, 35, 2, 4, 5, 19, g_kind, beta_kind, segments=True)
  _check("pallas", x, [(3, False)], 1e-5)


def test_pallas_fused_local_grouped(monkeypatch):
  """The fused chunk-local kernel (`pallas_chunk.FUSED_LOCAL`, interpreted on CPU) inside the grouped stage: its
  forward per group, each group's backward through `pallas_local`'s VJP (per-head decay and beta, no segments)."""
  from gdn.ops import pallas_chunk
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  x = make_inputs(37, 1, 35, 1, 2, 5, 7, "head", "head")
  want = oracle(x)
  got = test_ops.run("pallas", x, chunk_size=8, local_groups=3, switches=(("FUSED_LOCAL", True),))
  assert_close(got, want, 1e-5, "pallas fused local, 3 groups")


@pytest.mark.parametrize("method", ["chunk", "pallas"])
def test_bfloat16(method):
  """bfloat16 inputs (16-bit chunk-local operands and cotangents): against the oracle as test_ops' bfloat16
  test, and against the default path to its own rounding."""
  x_bf, x_ref = bfloat16_inputs(make_inputs(33, 2, 40, 2, 4, 16, 16, "head", "head", segments=True))
  default, want = run(method, x_bf), oracle(x_ref)
  settings = [(2, False)] + ([(2, True)] if method == "chunk" else [])
  for groups, output_vjp in settings:
    got = run(method, x_bf, local_groups=groups, output_vjp=output_vjp)
    assert_close(got, want, 2e-2, f"bf16 {method} {groups} {output_vjp}")
    assert rel(got[0], default[0]) < 1e-2 and all(rel(got[2][n], default[2][n]) < 1e-2 for n in got[2])


def test_default_reads_the_module_setting(monkeypatch):
  """local_groups=None reads intra_chunk.LOCAL_GROUPS at the call: the same program as passing it."""
  from gdn.ops import intra_chunk
  x = make_inputs(34, 1, 20, 1, 1, 8, 8, "head", "head")
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  kept = lambda **kw: residual_bytes(saved_residuals(
      lambda *a: ops.gated_delta_rule(*a, method="chunk", chunk_size=8, **kw)[0], *args))
  monkeypatch.setattr(intra_chunk, "LOCAL_GROUPS", 2)
  assert kept() == kept(local_groups=2) < kept(local_groups=1)


def test_output_vjp_keeps_less(monkeypatch):
  """chunk.OUTPUT_VJP keeps S_in and U once (XLA's autodiff of the scan keeps them as outputs and residuals)."""
  x = make_inputs(36, 1, 40, 1, 1, 8, 8, "head", "head")
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  kept = lambda: residual_bytes(saved_residuals(
      lambda *a: ops.gated_delta_rule(*a, method="chunk", chunk_size=8)[0], *args))
  plain = kept()
  monkeypatch.setattr(chunk, "OUTPUT_VJP", True)
  assert kept() < plain


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_local_groups(bad):
  x = make_inputs(35, 1, 20, 1, 1, 8, 8, "head", "head")
  with pytest.raises(ValueError, match="local_groups must be a positive int"):
    ops.gated_delta_rule(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), method="chunk",
                         local_groups=bad)
  with pytest.raises(ValueError, match="local_groups must be a positive int"):
    RecurrentConfig(local_groups=bad)


def test_layer_setting_gives_the_same_gradients():
  """RecurrentConfig.local_groups reaches the op: the layer's gradients equal the default's to float32
  rounding, and its backward keeps less."""
  x = jax.random.normal(jax.random.key(1), (2, 40, 32), jnp.float32)
  grads, kept = {}, {}
  for groups in (1, 4):
    cfg = recurrent_preset("gated_deltanet", num_heads=2, head_dim=16, method="chunk", chunk_size=16,
                           local_groups=groups)
    graphdef, params, rest = nnx.split(RecurrentMixer(cfg, 32, rngs=nnx.Rngs(0)), nnx.Param, ...)
    loss = lambda params, x: jnp.sum(nnx.merge(graphdef, params, rest)(x)[0] * jnp.cos(jnp.arange(x.size)).reshape(x.shape))
    grads[groups] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    kept[groups] = residual_bytes(saved_residuals(loss, params, x))
  for a, b in zip(jax.tree.leaves(grads[4]), jax.tree.leaves(grads[1])):
    scale = float(jnp.max(jnp.abs(b))) + 1e-30
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-5)
  assert kept[4] < kept[1]
