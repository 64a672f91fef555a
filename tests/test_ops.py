"""Every method of the gated delta rule against the float64 recurrence: outputs, final state, gradients.

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim, C chunk size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from reference import gated_delta_rule_ref

# Fewer XLA optimisations compile faster (conftest.py); the two oracle tests of every variant and dtype keep them.
pytestmark = pytest.mark.usefixtures("fast_compile")

KINDS = ("none", "head", "channel")
METHODS = ("recurrent", "chunk", "associative")
DIFF_ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(seed, B, T, H, HV, K, V, g_kind, beta_kind, *, init=True, segments=False, beta_max=2.0,
                dtype=np.float32):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, T, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)  # layers L2-normalise keys; the delta rule assumes it
  x = dict(q=rng.normal(size=(B, T, H, K)), k=k, v=rng.normal(size=(B, T, HV, V)))
  x["g"] = {"none": None, "head": np.log(rng.uniform(0.5, 1.0, (B, T, HV))),
            "channel": np.log(rng.uniform(0.5, 1.0, (B, T, HV, K)))}[g_kind]
  x["beta"] = {"none": None, "head": rng.uniform(0, beta_max, (B, T, HV)),
               "channel": rng.uniform(0, beta_max, (B, T, HV, V))}[beta_kind]
  x["initial_state"] = 0.5 * rng.normal(size=(B, HV, K, V)) if init else None
  x = {n: None if a is None else a.astype(dtype) for n, a in x.items()}
  x["segment_ids"] = (np.cumsum(rng.uniform(size=(B, T)) < 0.15, axis=1).astype(np.int32) if segments else None)
  return x


@functools.lru_cache(maxsize=None)
def _fwd_bwd(method, chunk_size, present, scale, local_groups=None, switches=(), g_lower_bound=None):
  """Jitted forward + VJP with fixed cotangents, differentiating every array argument present. switches: the
  module settings read at tracing that the caller has set (a cache key only)."""

  def f(diff, segment_ids, co):
    def op(diff):
      return ops.gated_delta_rule(diff["q"], diff["k"], diff["v"], diff.get("g"), diff.get("beta"),
                                  initial_state=diff.get("initial_state"), segment_ids=segment_ids,
                                  method=method, chunk_size=chunk_size, scale=scale, local_groups=local_groups,
                                  g_lower_bound=g_lower_bound)
    (o, S), vjp = jax.vjp(op, diff)
    (grads,) = vjp((co[0].astype(o.dtype), co[1].astype(S.dtype)))
    return o, S, grads

  return jax.jit(f)


def vjp_inputs(x, seed=1):
  """(differentiable inputs, segment_ids, cotangents of (o, S)): the same cotangents for the same seed."""
  diff = {n: jnp.asarray(x[n]) for n in DIFF_ARGS if x[n] is not None}
  B, T, HV, V = x["v"].shape
  K = x["q"].shape[-1]
  rng = np.random.default_rng(seed)
  co = (jnp.asarray(rng.normal(size=(B, T, HV, V))), jnp.asarray(rng.normal(size=(B, HV, K, V))))
  seg = None if x["segment_ids"] is None else jnp.asarray(x["segment_ids"])
  return diff, seg, co


def run(method, x, *, chunk_size=16, scale=None, seed=1, local_groups=None, switches=(), g_lower_bound=None):
  diff, seg, co = vjp_inputs(x, seed)
  o, S, grads = _fwd_bwd(method, chunk_size, tuple(sorted(diff)), scale, local_groups, switches,
                         g_lower_bound)(diff, seg, co)
  return np.asarray(o, np.float64), np.asarray(S, np.float64), {n: np.asarray(g, np.float64)
                                                                   for n, g in grads.items()}


def kda_grad_shapes(x, **op_kw):
  """Every array shape in the traced gradient of a per-key-channel op (`method="chunk"`) with respect to q, k
  and g, nested programs included: what the chunk-local stage builds, forward and backward."""
  import jax.extend

  def loss(q, k, g):
    o, _ = ops.gated_delta_rule(q, k, jnp.asarray(x["v"]), g, jnp.asarray(x["beta"]), method="chunk", **op_kw)
    return o.sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x[n]) for n in ("q", "k", "g")))
  shapes = set()

  def walk(jp):
    for eqn in jp.eqns:
      shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return shapes


def bfloat16_inputs(x):
  """(x with bfloat16 q, k, v, g, beta, the float32 values of those inputs for the oracle); the initial state
  stays float32, as the contract has it."""
  x_bf = {n: a if a is None or n in ("segment_ids", "initial_state") else jnp.asarray(a, jnp.bfloat16)
          for n, a in x.items()}
  return x_bf, {n: a if a is None or n == "segment_ids" else np.asarray(jnp.asarray(a, jnp.float32))
                for n, a in x_bf.items()}


def oracle(x, **kw):
  """The float64 recurrence: forward and gradients (the JAX token scan in float64), compiled with fewer
  optimisations also in a `full_optimizations` test (that marker is for the op under test, not its reference)."""
  x64 = {n: None if a is None or n == "segment_ids" else np.asarray(a, np.float64) for n, a in x.items()}
  x64["segment_ids"] = x["segment_ids"]
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    with jax.enable_x64(True):
      return run("recurrent", x64, **kw)
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def rel(a, b):
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(got, want, tol, what=""):
  o, S, grads = got
  o_ref, S_ref, grads_ref = want
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(S)), what
  assert rel(o, o_ref) < tol, f"{what} o: {rel(o, o_ref):.2e}"
  assert rel(S, S_ref) < tol, f"{what} final state: {rel(S, S_ref):.2e}"
  assert set(grads) == set(grads_ref)
  for n in grads:
    assert np.all(np.isfinite(grads[n])), f"{what} d{n} not finite"
    assert rel(grads[n], grads_ref[n]) < tol, f"{what} d{n}: {rel(grads[n], grads_ref[n]):.2e}"


def test_jax_oracle_is_the_seed_loop():
  """The float64 JAX scan (gradient oracle) equals the plain NumPy loop written from the seed."""
  for g_kind in KINDS:
    for beta_kind in KINDS:
      x = make_inputs(0, 2, 9, 1, 2, 3, 4, g_kind, beta_kind, segments=True)
      o, S, _ = oracle(x)
      o_np, S_np = gated_delta_rule_ref(**x)
      np.testing.assert_allclose(o, o_np, rtol=1e-10, atol=1e-12)
      np.testing.assert_allclose(S, S_np, rtol=1e-10, atol=1e-12)


@pytest.mark.full_optimizations
@pytest.mark.parametrize("g_kind", KINDS)
@pytest.mark.parametrize("beta_kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_all_variants_float32(method, g_kind, beta_kind):
  """All nine (g, beta) combinations; T = 2C + 3 with grouped heads, odd K, V, initial state, segments."""
  x = make_inputs(1, 2, 35, 2, 4, 5, 3, g_kind, beta_kind, segments=True)
  if method == "associative" and beta_kind == "channel":
    with pytest.raises(ValueError, match="associative.*per-value-channel beta"):
      run(method, x)
    return
  assert_close(run(method, x), oracle(x), 1e-5, f"{method} g={g_kind} beta={beta_kind}")


SHAPES = [  # B, T, H, HV, K, V, C: T = 1, C - 1, C + 1, longer; odd K and V; HV > H
    (1, 1, 1, 1, 4, 4, 16),
    (2, 15, 1, 3, 7, 5, 16),
    (1, 33, 2, 4, 9, 6, 32),
    (1, 65, 1, 1, 16, 8, 64),
    (1, 150, 2, 2, 8, 8, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("method, variant", [
    ("chunk", ("head", "head")), ("chunk", ("channel", "head")), ("chunk", ("head", "channel")),
    ("associative", ("head", "head")), ("associative", ("channel", "head"))])  # associative: no channel beta
def test_shapes_and_chunk_sizes(method, variant, shape):
  B, T, H, HV, K, V, C = shape
  x = make_inputs(2, B, T, H, HV, K, V, *variant)
  assert_close(run(method, x, chunk_size=C), oracle(x), 1e-5, f"{method} {variant} {shape}")


@pytest.mark.full_optimizations
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", [("head", "head"), ("channel", "head"), ("none", "none")])
def test_bfloat16_inputs(method, variant):
  x_bf, x_ref = bfloat16_inputs(make_inputs(3, 2, 40, 2, 2, 16, 16, *variant))
  got = run(method, x_bf)
  assert run(method, x_bf)[0].dtype == np.float64  # converted for comparison; the op returned bfloat16
  assert_close(got, oracle(x_ref), 2e-2, f"bf16 {method} {variant}")


def test_output_dtype_follows_v():
  """The dtypes are the trace's (`jax.eval_shape`: no op-by-op compiles of each method)."""
  x = make_inputs(4, 1, 20, 1, 1, 8, 8, "head", "head")
  v = jnp.asarray(x["v"], jnp.bfloat16)
  for method in METHODS:
    o, S = jax.eval_shape(functools.partial(ops.gated_delta_rule, method=method, chunk_size=16),
                          jnp.asarray(x["q"]), jnp.asarray(x["k"]), v)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32


def test_scale():
  x = make_inputs(5, 1, 21, 1, 1, 8, 8, "head", "head")
  assert_close(run("chunk", x, scale=0.3), oracle(x, scale=0.3), 1e-5, "scale")


# ---- torture ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", ["no_decay", "total_forgetting", "mixed_decay", "beta2", "identical_keys"])
def test_torture(method, case):
  B, T, H, HV, K, V = 1, 70, 1, 2, 8, 8
  g_kind = "channel" if case == "mixed_decay" else "head"
  x = make_inputs(6, B, T, H, HV, K, V, g_kind, "head", beta_max=1.0)
  if case == "no_decay":
    x["g"] = np.zeros_like(x["g"])
  elif case == "total_forgetting":
    x["g"] = np.full_like(x["g"], -1e4)
  elif case == "mixed_decay":
    # A strong decay followed by weak ones: differences of long cumulative sums would lose all precision.
    rng = np.random.default_rng(0)
    x["g"] = np.where(rng.uniform(size=x["g"].shape) < 0.1, -60.0, -0.01).astype(np.float32)
  elif case == "beta2":
    x["beta"] = np.full_like(x["beta"], 2.0)
  elif case == "identical_keys":
    x["k"] = np.broadcast_to(x["k"][:, :1], x["k"].shape).copy()
    x["beta"] = np.ones_like(x["beta"])
    x["g"] = np.zeros_like(x["g"])
  assert_close(run(method, x, chunk_size=32), oracle(x, chunk_size=32), 1e-5, f"{method} {case}")


@pytest.mark.slow
def test_long_sequence_2_17_chunk():
  """T = 2^17 in float32 through `chunk`: finite and equal to the token scan, forward and gradients."""
  x = make_inputs(7, 1, 2**17, 1, 1, 8, 8, "head", "head", beta_max=1.0)
  got, want = run("chunk", x, chunk_size=64), run("recurrent", x)
  assert_close(got, want, 1e-4, "T=2^17")


# ---- semantics -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_packed_segments_equal_separate_runs(method):
  """Forward only (the outputs and final states are compared): one compile per length, without a backward."""
  lengths = (13, 1, 40, 17)
  x = make_inputs(8, 1, sum(lengths), 1, 2, 8, 8, "channel", "head", init=False)
  x["segment_ids"] = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
  op = jax.jit(lambda q, k, v, g, beta, seg: ops.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, method=method,
                                                                   chunk_size=16))
  forward = lambda x: [np.asarray(a, np.float64) for a in op(*(None if x[n] is None else jnp.asarray(x[n])
                                                                for n in ("q", "k", "v", "g", "beta", "segment_ids")))]
  o, S = forward(x)
  start = 0
  for n in lengths:
    part = {k: (None if a is None or k == "initial_state" else a[:, start:start + n])
            for k, a in x.items()}
    part["segment_ids"] = None
    o_p, S_p = forward(part)
    np.testing.assert_allclose(o[:, start:start + n], o_p, rtol=1e-5, atol=1e-5)
    start += n
  np.testing.assert_allclose(S, S_p, rtol=1e-5, atol=1e-5)  # the final state is the last segment's


def _poisoned_inputs(beta_kind):
  """Three packed sequences per row over chunks of 16: 0..9, 10..25, 26..36 (the first and second share a
  chunk, the second and third too). Non-finite inputs: row 0, a NaN v in the first, a NaN q (its own output
  only), an inf k and a NaN g in the third; row 1, a NaN initial state (the first sequence) and an inf beta at
  the last position."""
  x = make_inputs(31, 2, 37, 1, 2, 4, 3, "head", beta_kind)
  x["segment_ids"] = np.repeat([[0, 1, 2]], [10, 16, 11], axis=1).repeat(2, axis=0).astype(np.int32)
  x["v"][0, 4, 1, 2] = np.nan
  x["q"][0, 28, 0, 1] = np.nan
  x["k"][0, 30, 0, 3] = np.inf
  x["g"][0, 33, 0] = np.nan
  x["initial_state"][1, 1, 2, 0] = np.nan
  x["beta"][1, 36, 0, ...] = np.inf
  return x


@pytest.mark.parametrize("method", ["chunk", "associative"])
def test_a_non_finite_input_reaches_no_other_packed_sequence(method):
  """The positions with a non-finite output are the recurrence's; elsewhere outputs and the final state equal
  the float64 recurrence's, and so do the gradients of a loss on the middle sequence's outputs, which a
  non-finite value in its neighbours (sharing its chunks) leaves finite."""
  x = _poisoned_inputs("head")
  keep = np.zeros(x["v"].shape[:3] + (1,), bool)
  keep[0, 10:26] = True
  w = np.random.default_rng(2).normal(size=x["v"].shape) * keep

  @functools.partial(jax.jit, static_argnums=0)
  def forward_and_grads(method, diff):
    def loss(d):
      o, S = ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                  segment_ids=jnp.asarray(x["segment_ids"]), method=method, chunk_size=16)
      return jnp.sum(jnp.where(keep, o, 0.0) * jnp.asarray(w, o.dtype)), (o, S)
    return jax.grad(loss, has_aux=True)(diff)

  f64 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
  got, (o, S) = f64(forward_and_grads(method, {n: jnp.asarray(x[n]) for n in DIFF_ARGS}))
  with jax.enable_x64(True):
    want, (o_ref, S_ref) = f64(forward_and_grads("recurrent", {n: jnp.asarray(x[n], jnp.float64)
                                                               for n in DIFF_ARGS}))
  bad = ~np.isfinite(o_ref).all(-1)  # [B, T, HV]
  assert bad[0, 4:10, 1].all() and not bad[0, :4].any() and bad[0, 28].all() and not bad[0, 10:28].any() \
      and not bad[0, 29].any() and bad[1, :10, 1].all(), "the setup"
  np.testing.assert_array_equal(~np.isfinite(o).all(-1), bad)
  np.testing.assert_allclose(o[~bad], o_ref[~bad], rtol=1e-4, atol=1e-5)
  bad_S = ~np.isfinite(S_ref).all((-2, -1))
  np.testing.assert_array_equal(~np.isfinite(S).all((-2, -1)), bad_S)
  np.testing.assert_allclose(S[~bad_S], S_ref[~bad_S], rtol=1e-4, atol=1e-5)
  for n in ("q", "k", "v", "g", "beta"):
    assert np.isfinite(got[n]).all(), f"d{n} has non-finite entries"
    np.testing.assert_allclose(got[n][0, 10:26], want[n][0, 10:26], rtol=1e-4, atol=1e-5, err_msg=f"d{n}")
    assert not got[n][:, 26:].any() and not got[n][1].any(), f"d{n} reaches another sequence"


def test_chunk_size_is_capped_at_the_length():
  """A chunk longer than the sequence is one chunk of T: the recurrence's numbers, and no padded chunk."""
  x = make_inputs(32, 1, 11, 1, 2, 4, 3, "channel", "head", segments=True)
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state", "segment_ids")]
  op = lambda method, chunk_size: jax.jit(lambda q, k, v, g, b, S0, seg: ops.gated_delta_rule(
      q, k, v, g, b, initial_state=S0, segment_ids=seg, method=method, chunk_size=chunk_size))
  o_ref, S_ref = op("recurrent", 64)(*args)
  for method in ("chunk", "associative"):
    o, S = op(method, 64)(*args)
    assert rel(np.asarray(o), np.asarray(o_ref)) < 1e-5 and rel(np.asarray(S), np.asarray(S_ref)) < 1e-5, method
    hlo = op(method, 64).lower(*args).as_text()
    assert "64x64" not in hlo and "11x11" in hlo, method


@pytest.mark.parametrize("method", METHODS)
def test_causality(method):
  """d o_t / d (inputs after t) is exactly zero."""
  x = make_inputs(9, 1, 40, 1, 1, 4, 4, "channel", "head")
  t0 = 21

  def o_t(diff):
    o, _ = ops.gated_delta_rule(diff["q"], diff["k"], diff["v"], diff["g"], diff["beta"], method=method,
                                chunk_size=16)
    return o[:, t0].sum()

  diff = {n: jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")}
  grads = jax.jit(jax.grad(o_t))(diff)  # one compile, not the op's many eager steps
  for n, gr in grads.items():
    assert np.all(np.asarray(gr)[:, t0 + 1:] == 0.0), f"{method}: d o_{t0} / d {n} leaks from the future"
    assert np.any(np.asarray(gr)[:, :t0 + 1] != 0.0)


def test_jit_and_no_jit_agree():
  x = make_inputs(10, 1, 30, 1, 1, 8, 8, "head", "head")
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  for method in METHODS:
    eager = ops.gated_delta_rule(*args, method=method, chunk_size=16)
    jitted = jax.jit(functools.partial(ops.gated_delta_rule, method=method, chunk_size=16))(*args)
    for a, b in zip(eager, jitted):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_step_is_one_token_of_the_scan():
  x = make_inputs(11, 2, 5, 1, 2, 4, 6, "channel", "channel")
  o, S, _ = oracle(x)
  state = jnp.asarray(x["initial_state"])
  for t in range(5):
    o_t, state = ops.gated_delta_rule_step(*(jnp.asarray(x[n][:, t]) for n in ("q", "k", "v", "g", "beta")),
                                           state=state)
    np.testing.assert_allclose(o_t, o[:, t], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state, S, rtol=1e-5, atol=1e-5)


def test_auto_matches_oracle():
  for T in (3, 50):
    x = make_inputs(12, 1, T, 1, 1, 8, 8, "head", "head")
    assert_close(run("auto", x), oracle(x), 1e-5, f"auto T={T}")


# ---- bad input -------------------------------------------------------------------------------------------


def _bad_cases():
  B, T, H, HV, K, V = 2, 8, 2, 4, 4, 3
  z = lambda *s: jnp.zeros(s, jnp.float32)
  ok = dict(q=z(B, T, H, K), k=z(B, T, H, K), v=z(B, T, HV, V))
  return [
      (dict(ok, q=z(T, H, K)), ValueError, "q must have rank 4"),
      (dict(ok, k=z(B, T, H, K + 1)), ValueError, "k must have the shape of q"),
      (dict(ok, v=z(B, T + 1, HV, V)), ValueError, "v must be"),
      (dict(ok, v=z(B, T, 3, V)), ValueError, "multiple of q/k's H"),
      (dict(ok, g=z(B, T, H)), ValueError, r"g must be None, of shape \[B, T, HV\]"),
      (dict(ok, g=z(B, T, HV, V + 5)), ValueError, "g must be"),
      (dict(ok, beta=z(B, T, HV, K + 2)), ValueError, "beta must be"),
      (dict(ok, initial_state=z(B, HV, V, K)), ValueError, "initial_state must be of shape"),
      (dict(ok, segment_ids=jnp.zeros((B, T), jnp.float32)), TypeError, "segment_ids must be an integer"),
      (dict(ok, segment_ids=jnp.zeros((B, T + 1), jnp.int32)), ValueError, "segment_ids must be None or of shape"),
      (dict(ok, method="fast"), ValueError, "method must be one of"),
      (dict(ok, chunk_size=0), ValueError, "chunk_size must be a positive int"),
      (dict(ok, q=jnp.zeros((B, T, H, K), jnp.int32)), TypeError, "q must be a floating-point"),
      (dict(ok, q=[[[[1.0] * K] * H] * T] * B), TypeError, "q must be a floating-point array, got list"),
      (dict(ok, scale=jnp.ones(2)), ValueError, r"scale must be None or a scalar, got an array of shape \(2,\)"),
  ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_clear_error(case):
  kwargs, err, msg = _bad_cases()[case]
  with pytest.raises(err, match=msg):
    ops.gated_delta_rule(**kwargs)


def test_step_bad_input():
  z = lambda *s: jnp.zeros(s, jnp.float32)
  with pytest.raises(ValueError, match="state must be of shape"):
    ops.gated_delta_rule_step(z(1, 2, 4), z(1, 2, 4), z(1, 2, 3), state=z(1, 2, 3, 4))
  with pytest.raises(ValueError, match="state is required"):
    ops.gated_delta_rule_step(z(1, 2, 4), z(1, 2, 4), z(1, 2, 3), state=None)
  with pytest.raises(ValueError, match=r"beta_t must be None, of shape \[B, HV\] = \(1, 2\) or \[B, HV, V\]"):
    ops.gated_delta_rule_step(z(1, 2, 4), z(1, 2, 4), z(1, 2, 3), beta_t=z(1, 3), state=z(1, 2, 4, 3))


def test_triangular_solver_matches_blocked():
  """The `lax.linalg.triangular_solve` path (kept for comparison) equals the default blocked inverse."""
  from gdn.ops import checks
  from gdn.ops.chunk import chunk

  for variant in (("head", "head"), ("channel", "head")):
    x = make_inputs(13, 1, 70, 1, 2, 8, 8, *variant, segments=True)
    a = {n: None if x[n] is None else jnp.asarray(x[n]) for n in x}
    dims = checks.check_sequence(a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"],
                                 a["segment_ids"], None, "chunk", 32)
    o_ref, S_ref, _ = oracle(x)
    for solver in ("triangular", "blocked"):
      run_chunk = jax.jit(lambda a: chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=8**-0.5,
                                          initial_state=a["initial_state"], segment_ids=a["segment_ids"], dims=dims,
                                          chunk_size=32, solver=solver))  # one compile, not many eager steps
      o, S = run_chunk(a)
      assert rel(np.asarray(o, np.float64), o_ref) < 1e-5 and rel(np.asarray(S, np.float64), S_ref) < 1e-5
