"""`method="pallas"` (the chunk form with its state pass as Pallas kernels) against the float64 recurrence.

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim, C chunk size, BV value block.

On CPU the kernels run in Pallas' interpreter (what `method="pallas"` does there by default), so the cases
are few and small: each combines several features (odd K and V, HV > H, T not a multiple of C, an initial
state, packed segments). The `gpu` tests run the compiled Triton kernels at a realistic shape. The
`fused_output` tests run `pallas_chunk.FUSED_OUTPUT` (the output inside the forward kernel) forward only and
differentiated. The batch-sharded test runs in a child process on 8 forced CPU devices (`devices.run_child`).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from gdn import ops
from gdn.ops import checks, pallas_chunk
from devices import run_child
from lowering import cuda_hlo
from test_ops import DIFF_ARGS, assert_close, bfloat16_inputs, make_inputs, oracle, rel, vjp_inputs

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


@functools.lru_cache(maxsize=None)
def _fwd_bwd(present, chunk_size, block_v, interpret, fused_output=False, bwd_states=None, narrow=None,
             from_output=None, products=None):
  """Jitted forward + VJP with fixed cotangents. With block_v and interpret None, through the public
  `gated_delta_rule(method="pallas")`; else through `pallas_chunk.pallas`, which takes them. fused_output:
  `pallas_chunk.FUSED_OUTPUT` as the caller set it (the switch is read at trace time, so it keys the cache); when
  true, the forward-only (o, S) come too, the only call that runs the fused output kernel. bwd_states:
  `pallas_chunk.BWD_STATES` as the caller set it (None: left at its default), likewise read at trace time (a key
  of the cache only); narrow, from_output and products: `pallas_chunk.NARROW_BLOCKS`, `BWD_FROM_OUTPUT` and
  (`BWD_PRODUCTS`, `PRODUCTS_BLOCK_K`), the same way."""

  def f(diff, segment_ids, co):
    def op(diff):
      args = (diff["q"], diff["k"], diff["v"], diff.get("g"), diff.get("beta"))
      if block_v is None and interpret is None:
        return ops.gated_delta_rule(*args, initial_state=diff.get("initial_state"), segment_ids=segment_ids,
                                    method="pallas", chunk_size=chunk_size)
      dims = checks.check_sequence(*args, diff.get("initial_state"), segment_ids, None, "auto", chunk_size)
      o, S = pallas_chunk.pallas(*args, scale=dims.K**-0.5, initial_state=diff.get("initial_state"),
                                 segment_ids=segment_ids, dims=dims, chunk_size=chunk_size,
                                 block_v=block_v or pallas_chunk.BLOCK_V, interpret=interpret)
      return o.astype(diff["v"].dtype), S

    (o, S), vjp = jax.vjp(op, diff)
    (grads,) = vjp((co[0].astype(o.dtype), co[1].astype(S.dtype)))
    return (o, S, grads) + ((op(diff),) if fused_output else ())

  return jax.jit(f)


def run_pallas(x, *, chunk_size=8, block_v=None, interpret=None, seed=1):
  """Forward, final state and all gradients, as `test_ops.run` (same cotangents for the same seed). With
  `pallas_chunk.FUSED_OUTPUT` set, a pair: that triple from the differentiated call, and the same with the
  forward-only call's output and final state."""
  diff, seg, co = vjp_inputs(x, seed)
  fused = pallas_chunk.FUSED_OUTPUT
  o, S, grads, *forward_only = _fwd_bwd(tuple(sorted(diff)), chunk_size, block_v, interpret, fused,
                                        pallas_chunk.BWD_STATES, pallas_chunk.NARROW_BLOCKS,
                                        pallas_chunk.BWD_FROM_OUTPUT,
                                        (pallas_chunk.BWD_PRODUCTS, pallas_chunk.PRODUCTS_BLOCK_K))(diff, seg, co)
  f64 = lambda o, S: (np.asarray(o, np.float64), np.asarray(S, np.float64),
                      {n: np.asarray(g, np.float64) for n, g in grads.items()})
  return (f64(o, S), f64(*forward_only[0])) if fused else f64(o, S)


# (g, beta, C, block_v). Every case has T = 35 (not a multiple of C), grouped heads, odd K and V, an initial
# state and packed segments. C = 8 is padded to 16 inside the kernels (Triton's smallest dot); C = 16 goes
# through the public `method="pallas"`. block_v = 16 with V = 19 splits the value channels over two programs,
# so the per-block partial sums of dW, dk_end and ddecay are checked too. Few cases, each compiled once:
# compiling the chunk-local XLA work dominates the runtime on CPU.
CASES = [
    ("head", "head", 16, None),  # Gated DeltaNet
    ("channel", "head", 8, 16),  # per-key-channel decay (KDA)
    ("none", "head", 8, 64),  # DeltaNet: no decay
    ("head", "none", 8, 16),  # no delta rule: gated linear attention
]


@pytest.mark.parametrize("g_kind, beta_kind, C, block_v", CASES)
def test_float32_against_oracle(g_kind, beta_kind, C, block_v):
  x = make_inputs(21, 2, 35, 2, 4, 5, 19, g_kind, beta_kind, segments=True)
  got = run_pallas(x, chunk_size=C, block_v=block_v)
  assert_close(got, oracle(x), 1e-5, f"pallas g={g_kind} beta={beta_kind} C={C}")


def test_bfloat16_inputs():
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 2, 16, 16, "head", "head"))
  assert_close(run_pallas(x_bf), oracle(x_ref), 2e-2, "bf16 pallas")


@pytest.mark.parametrize("g_kind, beta_kind", [("none", "head"), ("none", "none"), ("head", "none")])
def test_bfloat16_gradients_without_a_gate_or_beta(g_kind, beta_kind):
  """Without a decay gate k itself is k_end, without beta v itself is U0: 16-bit operands that reach the kernels
  uncast, whose cotangents must come back in their own dtype to be added to their other uses' (the naive delta
  rule's bfloat16 gradient failed with "lax.add requires arguments to have the same dtypes"). Every gradient in
  its input's dtype, and against the float64 oracle."""
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 2, 16, 16, g_kind, beta_kind))
  diff, seg, co = vjp_inputs(x_bf)
  _, _, grads = _fwd_bwd(tuple(sorted(diff)), 16, None, None)(diff, seg, co)
  assert {n: g.dtype for n, g in grads.items()} == {n: a.dtype for n, a in diff.items()}
  assert_close(run_pallas(x_bf), oracle(x_ref), 2e-2, f"bf16 pallas g={g_kind} beta={beta_kind}")


@pytest.mark.parametrize("g_kind, beta_kind, C, block_v", [CASES[1], CASES[3]])
def test_backward_states_against_oracle(monkeypatch, g_kind, beta_kind, C, block_v):
  """The backward kernel that BWD_STATES does not pick (the default run is tested above): with BWD_STATES on it
  writes dS per chunk and XLA forms dW, dk_end and ddecay over the whole of V (two value blocks here, so the sums
  cross blocks); off, each value block writes its float32 partial sums of them. With and without the delta rule,
  float32 and bfloat16."""
  flag = not pallas_chunk.BWD_STATES
  monkeypatch.setattr(pallas_chunk, "BWD_STATES", flag)
  x = make_inputs(21, 2, 35, 2, 4, 5, 19, g_kind, beta_kind, segments=True)
  assert_close(run_pallas(x, chunk_size=C, block_v=block_v), oracle(x), 1e-5, f"BWD_STATES={flag} g={g_kind} "
               f"beta={beta_kind}")
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 2, 16, 32, g_kind, beta_kind))
  assert_close(run_pallas(x_bf, chunk_size=C, block_v=16), oracle(x_ref), 2e-2, f"bf16 BWD_STATES={flag} g={g_kind}")


def test_backward_states_kernel_replaces_the_partial_sums(monkeypatch):
  """With BWD_STATES the differentiated call runs `gdn_chunk_dstates_bwd`, whose results are dU0, dS per chunk
  (operand dtype) and dS0: no [L, V / BV, N, Cp, Kp] partial sums. Per-value-channel beta keeps the old kernel."""
  for beta_kind, want in [("head", "gdn_chunk_dstates_bwd"), ("channel", "gdn_chunk_states_bwd")]:
    x_bf, _ = bfloat16_inputs(make_inputs(28, 1, 40, 1, 2, 16, 32, "head", beta_kind))
    diff = {n: jnp.asarray(x_bf[n]) for n in ("q", "k", "v", "g", "beta")}
    for flag in (False, True):
      monkeypatch.setattr(pallas_chunk, "BWD_STATES", flag)

      def loss(diff):
        o, _ = ops.gated_delta_rule(diff["q"], diff["k"], diff["v"], diff["g"], diff["beta"], method="pallas",
                                    chunk_size=16)
        return jnp.sum(o.astype(jnp.float32))

      names = [e.params["name"] for e in equations(jax.make_jaxpr(jax.grad(loss))(diff))]
      assert names[-1] == (want if flag else "gdn_chunk_states_bwd"), (beta_kind, flag, names)
      if flag and beta_kind == "head":
        (call,) = [e for e in equations(jax.make_jaxpr(jax.grad(loss))(diff)) if e.params["name"] == want]
        shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars]
        assert shapes == [((2, 3, 16, 32), jnp.float32), ((2, 3, 16, 32), jnp.bfloat16), ((2, 16, 32), jnp.float32)]


def _assert_fused_close(x, want, tol, what, **kw):
  """With FUSED_OUTPUT on (set by the caller): the forward-only call (the fused output kernel) and the
  differentiated one (the unfused forward and the backward kernel) both against `want`, gradients included."""
  differentiated, forward_only = run_pallas(x, **kw)
  assert_close(forward_only, want, tol, f"{what}, forward only")
  assert_close(differentiated, want, tol, f"{what}, differentiated")


@pytest.mark.parametrize("g_kind, beta_kind, C, block_v", CASES)
def test_fused_output_float32_against_oracle(monkeypatch, g_kind, beta_kind, C, block_v):
  """FUSED_OUTPUT: the output inside the state pass, on CASES' inputs (grouped heads, odd K and V, T not a
  multiple of C, an initial state, packed segments)."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  x = make_inputs(21, 2, 35, 2, 4, 5, 19, g_kind, beta_kind, segments=True)
  _assert_fused_close(x, oracle(x), 1e-5, f"fused output g={g_kind} beta={beta_kind} C={C}", chunk_size=C,
                      block_v=block_v)


@pytest.mark.parametrize("g_kind, beta_kind", [("head", "head"), ("channel", "none")])
def test_fused_output_bfloat16_against_oracle(monkeypatch, g_kind, beta_kind):
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 4, 16, 16, g_kind, beta_kind, segments=True))
  _assert_fused_close(x_bf, oracle(x_ref), 2e-2, f"bf16 fused output g={g_kind} beta={beta_kind}")


def _grad_jaxpr(x):
  """The jaxpr of the gradient of sum(o) through the public `method="pallas"` (chunk 32) at x's inputs, traced
  with the module switches as they are set now."""
  diff = {n: jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta") if x.get(n) is not None}

  def loss(diff):
    o, _ = ops.gated_delta_rule(diff["q"], diff["k"], diff["v"], diff["g"], diff.get("beta"), method="pallas",
                                chunk_size=32)
    return jnp.sum(o.astype(jnp.float32))

  return jax.make_jaxpr(jax.grad(loss))(diff)


@pytest.mark.parametrize("g_kind, beta_kind, C, block_v", [CASES[1], CASES[3]])
def test_backward_from_the_output_against_oracle(monkeypatch, g_kind, beta_kind, C, block_v):
  """BWD_FROM_OUTPUT: the dS kernel forms q_dec^T dO itself (two value blocks here), with and without the delta
  rule, float32 and bfloat16; the kernel then reads q_dec and dO, and no [.., N, Kp, Vp] cotangent of S_in."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  monkeypatch.setattr(pallas_chunk, "BWD_FROM_OUTPUT", True)
  x = make_inputs(21, 2, 35, 2, 4, 5, 19, g_kind, beta_kind, segments=True)
  _assert_fused_close(x, oracle(x), 1e-5, f"from output g={g_kind} beta={beta_kind}", chunk_size=C,
                      block_v=block_v)
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 2, 16, 32, g_kind, beta_kind))
  _assert_fused_close(x_bf, oracle(x_ref), 2e-2, f"bf16 from output g={g_kind}", chunk_size=C, block_v=16)

  for flag in (False, True):
    monkeypatch.setattr(pallas_chunk, "BWD_FROM_OUTPUT", flag)
    (call,) = [e for e in equations(_grad_jaxpr(x_bf)) if e.params["name"] == "gdn_chunk_dstates_bwd"]
    per_chunk = [tuple(v.aval.shape[-2:]) for v in call.invars if v.aval.ndim == 4]  # [L, N, ., .]
    assert ((16, 32) in per_chunk) != flag  # dS_in [.., Kp, Vp] read only without the switch (K 16, V 32, C 32)
    assert per_chunk.count((32, 16)) == 1 + (beta_kind != "none") + flag  # k_end, W, and q_dec with it


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("g_kind, beta_kind, C, block_v", [CASES[1], CASES[3]])
def test_backward_products_kernel_against_oracle(monkeypatch, fused, g_kind, beta_kind, C, block_v):
  """BWD_PRODUCTS: dW, dk_end, ddecay (and, differentiating the fused output pass, dq_dec) from one kernel over
  rows, chunks and key blocks (K 20 in two blocks of 16, V 19 in two value blocks), with and without the delta
  rule, float32 and bfloat16, against the float64 recurrence; then the kernel's operands and XLA's dots."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", fused)
  monkeypatch.setattr(pallas_chunk, "BWD_FROM_OUTPUT", fused)
  monkeypatch.setattr(pallas_chunk, "BWD_PRODUCTS", True)
  monkeypatch.setattr(pallas_chunk, "PRODUCTS_BLOCK_K", 16)
  check = _assert_fused_close if fused else (lambda x, want, tol, what, **kw: assert_close(run_pallas(x, **kw), want,
                                                                                          tol, what))
  x = make_inputs(21, 2, 35, 2, 4, 20, 19, g_kind, beta_kind, segments=True)
  check(x, oracle(x), 1e-5, f"products fused={fused} g={g_kind} beta={beta_kind}", chunk_size=C, block_v=block_v)
  x_bf, x_ref = bfloat16_inputs(make_inputs(23, 2, 40, 2, 2, 16, 32, g_kind, beta_kind))
  check(x_bf, oracle(x_ref), 2e-2, f"bf16 products fused={fused} g={g_kind}", chunk_size=C, block_v=16)

  dots = {}
  for flag in (False, True):
    monkeypatch.setattr(pallas_chunk, "BWD_PRODUCTS", flag)
    jaxpr = _grad_jaxpr(x_bf)
    calls = [e for e in equations(jaxpr) if e.params["name"] == "gdn_chunk_products_bwd"]
    dots[flag] = len(equations(jaxpr, "dot_general"))
    assert len(calls) == flag
  (call,) = calls  # S_in and dS [L, N, Kp, Vp] (K 16, V 32), U, dU0 (delta rule) and dO (fused) [L, N, Cp, Vp]
  assert [tuple(v.aval.shape[-2:]) for v in call.invars] == [(16, 32)] * 2 + [(32, 32)] * (
      1 + (beta_kind != "none") + fused)
  assert dots[False] - dots[True] == 1 + (beta_kind != "none")  # dk_end's and dW's dots (dq_dec's: XLA drops it)


def equations(jaxpr, primitive="pallas_call"):
  """The equations of `primitive` in a closed jaxpr, nested jaxprs included but not the kernels of pallas_calls
  (whose loops are scans)."""
  found = []
  for eqn in jaxpr.jaxpr.eqns:
    if eqn.primitive.name == primitive:
      found.append(eqn)
    if eqn.primitive.name == "pallas_call":
      continue
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else [p]):
        if isinstance(sub, ClosedJaxpr):
          found += equations(sub, primitive)
        elif isinstance(sub, Jaxpr):
          found += equations(ClosedJaxpr(sub, ()), primitive)
  return found


def test_fused_output_writes_no_states(monkeypatch):
  """A forward-only call with FUSED_OUTPUT runs one kernel whose results are O [L, N, Cp, Vp] in the output's
  dtype and S_T: no S_in, no U. FUSED_OUTPUT None leaves it off in the interpreter, as FUSED_LOCAL (off here, so
  that the state pass is the only kernel where they compile too)."""
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", False)
  x = make_inputs(28, 1, 40, 1, 2, 16, 16, "head", "head")
  x_bf, _ = bfloat16_inputs(x)
  for flag, want in [(True, True), (None, not pallas_chunk.default_interpret()), (False, False)]:
    monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", flag)
    args = [jnp.asarray(x_bf[n]) for n in ("q", "k", "v", "g", "beta")]
    jaxpr = jax.make_jaxpr(lambda *a: ops.gated_delta_rule(*a, method="pallas", chunk_size=16))(*args)
    (call,) = equations(jaxpr)
    shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars]
    if want:
      assert shapes == [((2, 3, 16, 16), jnp.bfloat16), ((2, 16, 16), jnp.float32)], shapes
    else:
      assert len(shapes) == 3 and shapes[0][0] == (2, 3, 16, 16), shapes  # S_in, U, S_T


def test_operand_dtype_follows_the_callers_precision(monkeypatch):
  """bfloat16 callers (DEFAULT precision) get bfloat16 kernel operands, float32 callers float32 ones; with
  BF16_OPERANDS off, both get float32. The state leaving the pass is float32 either way."""
  from gdn.ops.chunk import prepare
  x = make_inputs(27, 1, 16, 1, 1, 16, 16, "head", "head")
  args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")]
  dims = checks.check_sequence(*args, None, None, None, "pallas", 16)
  # Only dtypes are checked: traced, never compiled.
  loc = jax.eval_shape(lambda *a: prepare(*a, scale=0.25, segment_ids=None, dims=dims, chunk_size=16)[0], *args)
  S0 = jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.float32)
  for flag, prec, want in [(True, jax.lax.Precision.DEFAULT, jnp.bfloat16),
                           (True, jax.lax.Precision.HIGHEST, jnp.float32),
                           (False, jax.lax.Precision.DEFAULT, jnp.float32)]:
    monkeypatch.setattr(pallas_chunk, "BF16_OPERANDS", flag)
    S_T, S_in, U = jax.eval_shape(lambda loc, S0: pallas_chunk.state_pass(loc, S0, prec), loc, S0)
    assert (S_in.dtype, U.dtype, S_T.dtype) == (want, want, jnp.float32), (flag, prec)


def test_kernels_lower_to_triton():
  """The compiled path (not the interpreter) lowers for CUDA: both kernels become Triton calls. Catches
  what the interpreter accepts and Triton does not (shapes, dot layouts) without a GPU."""
  x = make_inputs(25, 1, 40, 1, 2, 5, 19, "channel", "head", segments=True)
  diff = {n: jnp.asarray(x[n]) for n in DIFF_ARGS}
  co = (jnp.ones((1, 40, 2, 19)), jnp.ones((1, 2, 5, 19)))
  fn = _fwd_bwd(tuple(sorted(diff)), 8, 16, False)
  hlo = cuda_hlo(fn, diff, jnp.asarray(x["segment_ids"]), co)
  assert hlo.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("beta_kind", ["head", "channel"])
def test_fused_output_kernel_lowers_to_triton(monkeypatch, beta_kind):
  """With FUSED_OUTPUT the forward-only call lowers to the fused kernel for CUDA (bfloat16, C = 64, K = V = 128,
  two value blocks; per-value-channel beta: its solve over four blocks of rows); the differentiated call to the
  unfused forward and the backward kernel (BWD_STATES' where it applies). (FUSED_LOCAL off: compiled, the
  chunk-local kernel would be a fourth.)"""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", False)
  x, _ = bfloat16_inputs(make_inputs(30, 1, 128, 1, 2, 128, 128, "head", beta_kind))
  diff = {n: jnp.asarray(x[n]) for n in DIFF_ARGS}
  co = (jnp.ones((1, 128, 2, 128), jnp.bfloat16), jnp.ones((1, 2, 128, 128)))
  hlo = cuda_hlo(_fwd_bwd(tuple(sorted(diff)), 64, None, False, True), diff, None, co)
  assert hlo.count("__gpu$xla.gpu.triton") == 3
  bwd = "gdn_chunk_dstates_bwd" if pallas_chunk.BWD_STATES and beta_kind == "head" else "gdn_chunk_states_bwd"
  assert all(hlo.count(name) >= 1 for name in ("gdn_chunk_output_fwd", "gdn_chunk_states_fwd", bwd))


def test_backward_states_kernel_lowers_to_triton(monkeypatch):
  """BWD_STATES' backward kernel lowers for CUDA (bfloat16, C = 64, K = V = 128, two value blocks)."""
  monkeypatch.setattr(pallas_chunk, "BWD_STATES", True)
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", False)
  x, _ = bfloat16_inputs(make_inputs(30, 1, 128, 1, 2, 128, 128, "head", "head"))
  diff = {n: jnp.asarray(x[n]) for n in DIFF_ARGS}
  co = (jnp.ones((1, 128, 2, 128), jnp.bfloat16), jnp.ones((1, 2, 128, 128)))
  hlo = cuda_hlo(_fwd_bwd(tuple(sorted(diff)), 64, None, False, False, True), diff, None, co)
  assert hlo.count("__gpu$xla.gpu.triton") == 2 and "gdn_chunk_dstates_bwd" in hlo


def test_wide_keys_against_oracle_and_launch(monkeypatch):
  """WIDE_KEYS at K > 128 (K = 160, padded to 256): value blocks of 32 and eight warps, float32 against the float64
  oracle with both backward kernels; lowered for CUDA, each state-pass kernel and the fused chunk-local kernel
  have that launch."""
  from gdn.bench.kernel_resources import triton_kernels

  monkeypatch.setattr(pallas_chunk, "WIDE_KEYS", True)
  x = make_inputs(33, 1, 40, 1, 2, 160, 40, "head", "head", segments=True)
  for bwd_states in (False, True):
    monkeypatch.setattr(pallas_chunk, "BWD_STATES", bwd_states)
    assert_close(run_pallas(x, chunk_size=16), oracle(x), 1e-5, f"wide keys, BWD_STATES={bwd_states}")
    x_bf, _ = bfloat16_inputs(x)
    diff = {n: jnp.asarray(x_bf[n]) for n in DIFF_ARGS}
    co = (jnp.ones((1, 40, 2, 40), jnp.bfloat16), jnp.ones((1, 2, 160, 40)))
    kernels = triton_kernels(_fwd_bwd(tuple(sorted(diff)), 16, None, False, False, bwd_states), diff, None, co)
    assert [(k.name, k.grid, k.num_warps) for k in kernels if k.name != "gdn_chunk_local"] == [
        ("gdn_chunk_states_fwd", (2, 2, 1), 8),
        ("gdn_chunk_dstates_bwd" if bwd_states else "gdn_chunk_states_bwd", (2, 2, 1), 8)], kernels
  # A forward-only call runs the fused chunk-local kernel (where kernels compile), at eight warps too.
  dims = checks.check_sequence(*(diff[n] for n in ("q", "k", "v", "g", "beta")), None, None, None, "pallas", 16)
  forward = jax.jit(lambda *a: pallas_chunk.pallas(*a, scale=0.1, initial_state=None, segment_ids=None, dims=dims,
                                                   chunk_size=16, interpret=False)[0])
  kernels = triton_kernels(forward, *(diff[n] for n in ("q", "k", "v", "g", "beta")))
  assert [(k.name, k.num_warps) for k in kernels][0] == ("gdn_chunk_local", 8), kernels


def _gpu_inputs(seed, dtype, g_kind="head", beta_kind="head"):
  """(inputs, the oracle's inputs) at a realistic shape: B = 2, T = 1024, H = 4, K = V = 128, with segments."""
  x = make_inputs(seed, 2, 1024, 4, 4, 128, 128, g_kind, beta_kind, segments=True)
  return bfloat16_inputs(x) if dtype == "bfloat16" else (x, x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_compiled_on_gpu(dtype, tol):
  """The compiled Triton kernels at a realistic shape: B = 2, T = 1024, H = 4, K = V = 128."""
  x, x_ref = _gpu_inputs(26, dtype)
  assert_close(run_pallas(x, chunk_size=64, interpret=False), oracle(x_ref), tol, f"gpu pallas {dtype}")


def _grids(monkeypatch):
  """The value-block count of every state-pass kernel launched from now on (the grid's second axis)."""
  seen = []
  call = pallas_chunk._call
  monkeypatch.setattr(pallas_chunk, "_call", lambda kernel, cfg, grid, *a: (seen.append(grid[1]),
                                                                             call(kernel, cfg, grid, *a))[1])
  return seen


def test_narrow_blocks_against_oracle(monkeypatch):
  """NARROW_BLOCKS: value blocks of 32 where B * HV programs per block are fewer than NARROW_BELOW (V = 64 here:
  two blocks instead of one), forward and backward against the oracle; above the bound the blocks stay."""
  x = make_inputs(31, 1, 24, 2, 2, 8, 64, "head", "head")
  monkeypatch.setattr(pallas_chunk, "NARROW_BLOCKS", True)
  seen = _grids(monkeypatch)
  assert_close(run_pallas(x, chunk_size=8, block_v=64), oracle(x), 1e-5, "narrow blocks")
  assert seen and set(seen) == {2}, seen
  monkeypatch.setattr(pallas_chunk, "NARROW_BELOW", 2)  # 2 programs (B * HV = 2, one block) are not fewer than 2
  seen.clear()  # another length, so that the cached jitted function traces again and reads the bound
  run_pallas(make_inputs(32, 1, 16, 2, 2, 8, 64, "head", "head"), chunk_size=8, block_v=64)
  assert seen and set(seen) == {1}, seen


def test_narrow_bound_follows_the_device(monkeypatch):
  """NARROW_BELOW None: the default device's multiprocessor count, 132 where it reports none; an int wins."""
  class Card:
    core_count = 108

  monkeypatch.setattr(pallas_chunk, "NARROW_BELOW", None)
  monkeypatch.setattr(jax, "devices", lambda *a: [object()])
  assert pallas_chunk.narrow_below() == 132
  monkeypatch.setattr(jax, "devices", lambda *a: [Card()])
  assert pallas_chunk.narrow_below() == 108
  monkeypatch.setattr(pallas_chunk, "NARROW_BELOW", 7)
  assert pallas_chunk.narrow_below() == 7


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["BWD_STATES", "NARROW_BLOCKS"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_switch_compiled_on_gpu(monkeypatch, switch, dtype, tol):
  """BWD_STATES (dS per chunk) and NARROW_BLOCKS (here B * HV = 8: value blocks of 32), each set the other way from
  its default (test_compiled_on_gpu runs the defaults), with the compiled kernels at test_compiled_on_gpu's shape."""
  monkeypatch.setattr(pallas_chunk, switch, not getattr(pallas_chunk, switch))
  x, x_ref = _gpu_inputs(26, dtype)
  assert_close(run_pallas(x, chunk_size=64, interpret=False), oracle(x_ref), tol, f"gpu {switch} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, g_kind, beta_kind, tol", [("float32", "head", "head", 1e-4),
                                                           ("bfloat16", "head", "head", 5e-2),
                                                           ("float32", "channel", "none", 1e-4)])
@pytest.mark.parametrize("from_output", [False, True])
def test_fused_output_compiled_on_gpu(monkeypatch, dtype, g_kind, beta_kind, tol, from_output):
  """FUSED_OUTPUT with the compiled kernels at test_compiled_on_gpu's shape: forward only and differentiated
  (the backward's q_dec^T dO in XLA, or with BWD_FROM_OUTPUT in the dS kernel)."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  monkeypatch.setattr(pallas_chunk, "BWD_FROM_OUTPUT", from_output)
  x, x_ref = _gpu_inputs(29, dtype, g_kind, beta_kind)
  _assert_fused_close(x, oracle(x_ref), tol, f"gpu fused output {dtype} g={g_kind} beta={beta_kind}", chunk_size=64,
                      interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, g_kind, beta_kind, tol", [("float32", "head", "head", 1e-4),
                                                           ("bfloat16", "head", "head", 5e-2),
                                                           ("float32", "channel", "none", 1e-4)])
def test_products_kernel_compiled_on_gpu(monkeypatch, dtype, g_kind, beta_kind, tol):
  """BWD_PRODUCTS with the compiled kernels at test_compiled_on_gpu's shape, differentiating the fused output pass
  (dq_dec in the kernel too) with BWD_FROM_OUTPUT, and the plain state pass."""
  monkeypatch.setattr(pallas_chunk, "BWD_PRODUCTS", True)
  monkeypatch.setattr(pallas_chunk, "BWD_FROM_OUTPUT", True)
  x, x_ref = _gpu_inputs(29, dtype, g_kind, beta_kind)
  want = oracle(x_ref)
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  _assert_fused_close(x, want, tol, f"gpu products {dtype} g={g_kind} beta={beta_kind}", chunk_size=64,
                      interpret=False)
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", False)
  assert_close(run_pallas(x, chunk_size=64, interpret=False), want, tol, f"gpu products, state pass, {dtype}")


# (g, beta): the state pass with W, without it and with the per-value-channel solve, so every operand list of the
# kernel ops is partitioned.
SHARDED_CASES = [("head", "head"), ("channel", "none"), ("head", "channel")]


def _sharded_child():
  """Prints, per case, the relative errors of the batch-sharded jitted forward + VJP against the same function
  on one device, and the number of all-gathers in its compiled module."""
  from gdn.train.sharding import batch_sharding, make_mesh

  mesh = make_mesh(data=4, fsdp=2)  # the batch split over both axes, as in data-parallel / FSDP training
  rows = batch_sharding(mesh)
  out = []
  for g_kind, beta_kind in SHARDED_CASES:
    x = make_inputs(27, 8, 20, 1, 2, 5, 6, g_kind, beta_kind, segments=True)
    diff, seg, co = vjp_inputs(x)
    fn = _fwd_bwd(tuple(sorted(diff)), 8, None, None)  # the public method="pallas"
    o_ref, S_ref, g_ref = fn(diff, seg, co)  # uncommitted inputs: one device
    args = jax.device_put((diff, seg, co), rows)
    compiled = fn.lower(*args).compile()  # run as compiled here: no second compile
    hlo = compiled.as_text()
    o, S, grads = compiled(*args)
    errs = {"o": rel(np.asarray(o), np.asarray(o_ref)), "final_state": rel(np.asarray(S), np.asarray(S_ref))}
    errs.update({f"d{n}": rel(np.asarray(grads[n]), np.asarray(g_ref[n])) for n in grads})
    out.append({"case": f"g={g_kind} beta={beta_kind}", "errors": errs, "all_gathers": hlo.count("all-gather"),
                "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)})
    if beta_kind == "head":  # the other backward kernel's op (BWD_STATES flipped), partitioned the same way
      default = pallas_chunk.BWD_STATES
      pallas_chunk.BWD_STATES = not default
      fn = _fwd_bwd(tuple(sorted(diff)), 8, None, None, False, not default)
      compiled = fn.lower(*args).compile()
      hlo = compiled.as_text()
      o, S, grads = compiled(*args)
      pallas_chunk.BWD_STATES = default
      errs = {"o": rel(np.asarray(o), np.asarray(o_ref))}
      errs.update({f"d{n}": rel(np.asarray(grads[n]), np.asarray(g_ref[n])) for n in grads})
      out.append({"case": f"BWD_STATES={not default}, g={g_kind} beta={beta_kind}", "errors": errs,
                  "all_gathers": hlo.count("all-gather"), "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)})
      # Differentiated with FUSED_OUTPUT and BWD_FROM_OUTPUT: the dS kernel's op with q_dec and dO as operands.
      before = pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT
      pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT = True, True
      fn = _fwd_bwd(tuple(sorted(diff)), 8, None, None, True, default, None, True)
      compiled = fn.lower(*args).compile()
      hlo = compiled.as_text()
      o, S, grads, _ = compiled(*args)
      pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT = before
      errs = {"o": rel(np.asarray(o), np.asarray(o_ref))}
      errs.update({f"d{n}": rel(np.asarray(grads[n]), np.asarray(g_ref[n])) for n in grads})
      out.append({"case": f"BWD_FROM_OUTPUT, g={g_kind} beta={beta_kind}", "errors": errs,
                  "all_gathers": hlo.count("all-gather"), "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)})
      # And with BWD_PRODUCTS: the products kernel's op (dq_dec included).
      before = pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT, pallas_chunk.BWD_PRODUCTS
      pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT, pallas_chunk.BWD_PRODUCTS = True, True, True
      fn = _fwd_bwd(tuple(sorted(diff)), 8, None, None, True, default, None, True, (True, 64))
      compiled = fn.lower(*args).compile()
      hlo = compiled.as_text()
      o, S, grads, _ = compiled(*args)
      pallas_chunk.FUSED_OUTPUT, pallas_chunk.BWD_FROM_OUTPUT, pallas_chunk.BWD_PRODUCTS = before
      errs = {"o": rel(np.asarray(o), np.asarray(o_ref))}
      errs.update({f"d{n}": rel(np.asarray(grads[n]), np.asarray(g_ref[n])) for n in grads})
      out.append({"case": f"BWD_PRODUCTS, g={g_kind} beta={beta_kind}", "errors": errs,
                  "all_gathers": hlo.count("all-gather"), "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)})
    # The forward-only call with FUSED_OUTPUT (the fused kernel's op) against the same one-device results.
    pallas_chunk.FUSED_OUTPUT = True
    fwd = jax.jit(lambda d, seg: ops.gated_delta_rule(d["q"], d["k"], d["v"], d.get("g"), d.get("beta"),
                                                      initial_state=d["initial_state"], segment_ids=seg,
                                                      method="pallas", chunk_size=8))
    args = jax.device_put((diff, seg), rows)
    compiled = fwd.lower(*args).compile()
    hlo = compiled.as_text()
    o, S = compiled(*args)
    pallas_chunk.FUSED_OUTPUT = False
    errs = {"o": rel(np.asarray(o), np.asarray(o_ref)), "final_state": rel(np.asarray(S), np.asarray(S_ref))}
    out.append({"case": f"fused output, forward only, g={g_kind} beta={beta_kind}", "errors": errs,
                "all_gathers": hlo.count("all-gather"), "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)})
  print(json.dumps(out))


@pytest.mark.slow
def test_batch_sharded_runs_per_device():
  """With the batch split over an 8-device ("data", "fsdp") mesh, outputs, final state and all gradients equal
  one device's, and the compiled module gathers nothing: each device runs the kernels on its own rows. The same
  for the forward-only call with FUSED_OUTPUT (the fused output kernel's op), for BWD_STATES' backward, for
  BWD_FROM_OUTPUT's and for BWD_PRODUCTS' kernel."""
  results = run_child(__file__)
  assert len(results) == 2 * len(SHARDED_CASES) + 3
  for r in results:
    bad = {n: e for n, e in r["errors"].items() if not e <= 1e-5}
    assert not bad, f"{r['case']}: relative error above 1e-5: {bad}"
    assert r["all_gathers"] == 0, f"{r['case']}: {r['all_gathers']} all-gathers in the compiled module"
    assert r["o_stays_sharded"], r["case"]


if __name__ == "__main__":
  _sharded_child()


@pytest.mark.parametrize("beta_kind, products", [("head", False), ("channel", False), ("head", True)])
def test_vmap_folds_the_mapped_axis_into_the_batch(monkeypatch, beta_kind, products):
  """Under `jax.vmap` (sweep cells stacked by `gdn.train.train_stacked`) the kernels' `custom_partitioning` ops,
  which have no batching rule of their own, fold the mapped axis into the batch: the vmapped forward and
  gradients equal each member's own call. The initial state is left unmapped (broadcast by the rule). products:
  with BWD_PRODUCTS' kernel in the backward."""
  monkeypatch.setattr(pallas_chunk, "BWD_PRODUCTS", products)
  xs = [make_inputs(s, 1, 20, 1, 2, 8, 8, "head", beta_kind, segments=True) for s in (31, 32)]
  names = ("q", "k", "v", "g", "beta")
  S0, seg = jnp.asarray(xs[0]["initial_state"]), jnp.asarray(xs[0]["segment_ids"])

  def loss(*arrays):
    o, S = ops.gated_delta_rule(*arrays, initial_state=S0, segment_ids=seg, method="pallas", chunk_size=16)
    return jnp.sum(o * o) + jnp.sum(jnp.sin(S))

  grad = jax.value_and_grad(loss, argnums=tuple(range(len(names))))
  stacked = [jnp.stack([jnp.asarray(x[n]) for x in xs]) for n in names]
  value, grads = jax.jit(jax.vmap(grad))(*stacked)
  for i, x in enumerate(xs):
    want_value, want_grads = jax.jit(grad)(*(jnp.asarray(x[n]) for n in names))
    assert rel(np.asarray(value[i]), np.asarray(want_value)) < 1e-6
    for n, got, want in zip(names, grads, want_grads):
      assert rel(np.asarray(got[i]), np.asarray(want)) < 1e-5, n
