"""`intra_chunk.SEGSUM_MATMUL`: a per-head decay's pairwise log-decays seg[t, i] = sum_{i < j <= t} g_j and the
other span sums of the log-decays as float32 matmuls with 0/1 tensors. The same direct sums as the cumulative
sums (no difference of long sums), the op's outputs and gradients against the float64 oracle, and no cumulative
sum left in the op or its VJP. `intra_chunk.PAIR_REMAT`: what the chunk-local stage keeps.
"""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.ops import intra_chunk
import test_ops
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, rel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _direct(g):
  """float64 sums over each span, term by term."""
  L, C = g.shape
  out = np.zeros((L, C, C))
  for t in range(C):
    for i in range(t):
      out[:, t, i] = g[:, i + 1:t + 1].astype(np.float64).sum(axis=1)
  return out


def test_matmul_is_the_cumulative_sum_and_keeps_precision_under_strong_decay():
  """A strong decay (-30 a step) before weak ones (-1e-3): a difference of two cumulative sums would lose the weak
  spans (their sum is 4 orders of magnitude below the total), the direct sums keep them to float32 rounding."""
  rng = np.random.default_rng(0)
  C = 32
  g = -rng.uniform(0.5, 1.0, (6, C)) * 1e-3
  g[:, :8] = -30.0
  want = _direct(g)
  got = {}
  for on in (False, True):
    seg = jax.jit(lambda g: intra_chunk._segsum(g, 1, mode="matmul" if on else "cumsum"))  # per setting: jit caches by function identity
    got[on] = np.asarray(seg(jnp.asarray(g, jnp.float32)), np.float64)
    below = np.tril(np.ones((C, C), bool), -1)
    err = np.abs(got[on] - want)[:, below] / np.maximum(np.abs(want[:, below]), 1e-30)
    assert err.max() < 1e-5, (on, err.max())
    assert np.all(got[on][:, ~below] == 0), on
  np.testing.assert_allclose(got[True], got[False], rtol=1e-6, atol=0)
  # float64 stays float64
  with jax.enable_x64(True):
    out = intra_chunk._segsum_matmul(jnp.asarray(g), 1)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method, g_kind", [("chunk", "head"), ("pallas", "head"), ("chunk", "channel")])
def test_op_against_the_oracle(monkeypatch, method, g_kind):
  """float32 (1e-5) and bfloat16 (1e-2) inputs with grouped value heads, packed segments, an initial state and T
  not a multiple of C, per-head and per-key-channel decay (the latter over sub-chunks of 16 in chunks of 32):
  outputs, final state and gradients against the float64 oracle, and float32 against the cumulative-sum path to
  float32 rounding, the matmuls with any VJP ("primal": outputs from the matmuls, gradients from the cumulative
  sums; "vjp": gradients from the matmuls' transposes)."""
  C = 32 if g_kind == "channel" else 16
  x = make_inputs(61, 2, 45, 1, 2, 16, 16, g_kind, "head", segments=True)
  want = oracle(x, chunk_size=C)
  got = {}
  for on in (False, True, "primal", "vjp"):
    monkeypatch.setattr(intra_chunk, "SEGSUM_MATMUL", on)
    got[on] = test_ops.run(method, x, chunk_size=C, switches=(("SEGSUM_MATMUL", on),))
  assert_close(got[True], want, 1e-5, f"{method} float32")
  assert_close(got[True], got[False], 1e-6, f"{method} float32 on vs off")
  assert_close(got["primal"], got[False], 1e-6, f"{method} float32 primal vs off")
  assert_close(got["vjp"], got[False], 1e-6, f"{method} float32 vjp vs off")
  x_bf, x_ref = bfloat16_inputs(x)
  want = oracle(x_ref, chunk_size=C)
  got = test_ops.run(method, x_bf, chunk_size=C, switches=(("SEGSUM_MATMUL", True),))
  assert_close(got, want, 1e-2, f"{method} bfloat16")


def _cumsums(jaxpr):
  """The operand shapes of the cumulative (and windowed) sums in the jaxpr and every sub-jaxpr."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("cumsum", "reduce_window_sum"):
      found.append(eqn.invars[0].aval.shape)
    for p in eqn.params.values():
      inner = getattr(p, "jaxpr", None)
      if inner is not None:
        found += _cumsums(inner if hasattr(inner, "eqns") else inner.jaxpr)
  return found


def _vjp_cumsums(diff, co, C):
  """`_cumsums` of the differentiated op (method chunk, chunk C) under the switches as they are now (traced anew
  each call: make_jaxpr caches traces by function identity)."""
  def f(diff):
    def op(d):
      return test_ops.ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], method="chunk",
                                           chunk_size=C)[0]
    o, vjp = jax.vjp(op, diff)
    return vjp(co[0].astype(o.dtype))

  return _cumsums(jax.make_jaxpr(f)(diff).jaxpr)


@pytest.mark.parametrize("g_kind, C", [("head", 16), ("channel", 32)])
def test_the_switch_leaves_no_cumulative_sum(monkeypatch, g_kind, C):
  """With the switch on, neither the op (no segments; per-key-channel decay over two sub-chunks a chunk) nor its
  VJP takes a cumulative sum; with it off they do (so the check can fail). The default (None) is on for a per-head
  decay and KDA's dyadic form (the one here); "primal" takes none where the op is not differentiated and the same
  ones as off where it is; "vjp" only the forward's of those (its VJP takes the matmuls' transposes)."""
  x = make_inputs(62, 1, 64, 1, 1, 16, 16, g_kind, "head")
  diff, seg, co = test_ops.vjp_inputs(x)
  found = {}
  assert intra_chunk.SEGSUM_MATMUL is None
  for on in (False, True, None, "primal", "vjp"):
    monkeypatch.setattr(intra_chunk, "SEGSUM_MATMUL", on)
    found[on] = _vjp_cumsums(diff, co, C)

    def fwd_only(diff):
      return test_ops.ops.gated_delta_rule(diff["q"], diff["k"], diff["v"], diff["g"], diff["beta"],
                                           method="chunk", chunk_size=C)[0]
    alone = _cumsums(jax.make_jaxpr(fwd_only)(diff).jaxpr)
    assert (alone == []) == (on is not False), (on, alone)  # the forward alone: no cumulative sum unless off
  assert found[True] == [], found[True]
  assert found[False], found[False]
  assert found[None] == found[True], found[None]
  # "primal", differentiated: the cumulative sums' forward and their transposes, as off
  assert sorted(found["primal"]) == sorted(found[False]), (found["primal"], found[False])
  # "vjp", differentiated: the forward's cumulative sums, none of their transposes
  assert found["vjp"] and len(found["vjp"]) < len(found[False]), (found["vjp"], found[False])
  assert not Counter(found["vjp"]) - Counter(found[False]), (found["vjp"], found[False])
  if g_kind == "head":
    assert (4, 16) in found[False] and (4, 16, 16) in found[False], found[False]


def test_the_default_follows_the_form(monkeypatch):
  """The default (None) for a per-key-channel decay: the matmuls (as on) for the dyadic form, "primal" for the
  pairwise one (as each was last timed), in the differentiated op."""
  x = make_inputs(63, 1, 64, 1, 1, 16, 16, "channel", "head")
  diff, seg, co = test_ops.vjp_inputs(x)
  found = {}
  for dyadic in (True, False):
    monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_DYADIC", dyadic)
    for on in (None, True, "primal"):
      monkeypatch.setattr(intra_chunk, "SEGSUM_MATMUL", on)
      found[dyadic, on] = sorted(_vjp_cumsums(diff, co, 32))
  assert found[True, None] == found[True, True] == [], found[True, None]
  assert found[False, None] == found[False, "primal"] and found[False, None], found[False, None]


@pytest.mark.parametrize("segsum_matmul", [False, True])
def test_pair_remat_keeps_no_pair_products(monkeypatch, segsum_matmul):
  """`intra_chunk.PAIR_REMAT`: the chunk-local stage's VJP no longer keeps the float32 [L, C, C] products K K^T
  and Q K^T (nor the decay matrix and what the pair stage derives from it: recomputed in the backward), and gives the same outputs and input cotangents to float32
  rounding (packed segments; what is kept with bfloat16 inputs, the values with float32 ones)."""
  from gdn.bench.residuals import saved_residuals
  from test_local_vjp import local_inputs

  monkeypatch.setattr(intra_chunk, "SEGSUM_MATMUL", segsum_matmul)
  L, C, K, V = 3, 32, 16, 8
  arrays, masks = local_inputs(5, L, C, K, V, jnp.bfloat16, segments=True)
  arrays32 = [x.astype(jnp.float32) for x in arrays]  # the values compared in float32: the two programs fuse
  rng = np.random.default_rng(0)                     # differently, which moves bfloat16 roundings
  res, outs = {}, {}
  for on in (False, True):
    monkeypatch.setattr(intra_chunk, "PAIR_REMAT", on)
    fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=jax.lax.Precision.HIGHEST)
    res[on] = [(r.shape, str(r.dtype), r.what) for r in saved_residuals(fn, *arrays, *masks)
               if r.what != "argument"]
    if not outs:
      shapes = jax.eval_shape(fn, *arrays32, *masks)
      cts = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), shapes)

    @jax.jit  # traced afresh under this setting
    def out_and_cotangents(xs, cts):
      out, pull = jax.vjp(fn, *xs)
      return out, pull(cts)[:5]

    outs[on] = out_and_cotangents((*arrays32, *masks), cts)
  products = {on: [r for r in res[on] if "...tk,...ik->...ti" in r[2]] for on in res}
  assert len(products[False]) == 2 and products[True] == [], products
  pairs = {on: sum(r[:2] == ((L, C, C), "float32") for r in res[on]) for on in res}
  assert pairs[True] <= pairs[False] - 2, (pairs, res[True])
  for a, b in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
    if a is None:
      continue
    assert rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-5


def test_channel_pair_remat_keeps_no_sub_chunk_decays(monkeypatch):
  """`intra_chunk.CHANNEL_PAIR_REMAT`: with a per-key-channel decay the chunk-local stage's VJP no longer keeps
  the pair stage's float32 sub-chunk tensors (the diagonal blocks' [L, M, c, c, K] decays, the off-diagonal
  [L, n, m, c, K] factors), keeps fewer bytes, and gives the same outputs and input cotangents to float32
  rounding (packed segments). The pairwise-decay form (`CHANNEL_PAIR_DYADIC` off), whose tensors these are."""
  from gdn.bench.residuals import saved_residuals
  from test_local_vjp import local_inputs

  monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_DYADIC", False)
  L, C, K, V = 2, 32, 8, 8
  M, c = C // intra_chunk.SUB_CHUNK, intra_chunk.SUB_CHUNK
  arrays, masks = local_inputs(5, L, C, K, V, jnp.bfloat16, segments=True)
  arrays[3] = jnp.asarray(np.log(np.random.default_rng(1).uniform(0.5, 1.0, (L, C, K))), jnp.float32)  # per key
  arrays32 = [x.astype(jnp.float32) for x in arrays]
  rng = np.random.default_rng(0)
  kept, outs = {}, {}
  for on in (False, True):
    monkeypatch.setattr(intra_chunk, "CHANNEL_PAIR_REMAT", on)
    fn = lambda *xs: intra_chunk.local(*xs[:5], xs[5:], beta_kind="head", prec=jax.lax.Precision.HIGHEST)
    kept[on] = [r for r in saved_residuals(fn, *arrays, *masks) if r.what != "argument"]
    if not outs:
      shapes = jax.eval_shape(fn, *arrays32, *masks)
      cts = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), shapes)
    outs[on] = jax.jit(lambda xs, ct: (lambda o, pull: (o, pull(ct)[:5]))(*jax.vjp(fn, *xs)))(
        (*arrays32, *masks), cts)
  sub = {on: [r.shape for r in kept[on] if r.shape in ((L, M, c, c, K), (L, M, M, c, K))] for on in kept}
  assert sub[False] and not sub[True], sub
  nbytes = {on: sum(r.bytes for r in kept[on]) for on in kept}
  assert nbytes[True] < nbytes[False] / 2, nbytes
  for a, b in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
    if a is None:
      continue
    assert rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-5
