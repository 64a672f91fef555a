"""The fused chunk-local Pallas kernel (`pallas_local`) against `intra_chunk.local`, and `method="pallas"` with it
(`pallas_chunk.FUSED_LOCAL`) against the float64 recurrence.

Shapes: L chunks, C chunk size, K key dim, V value dim; B batch, T time, H q/k heads, HV value heads.

On CPU the kernel runs in Pallas' interpreter, so the shapes are small; the `gpu` test runs it compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import intra_chunk, pallas_chunk, pallas_local
from lowering import cuda_hlo
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, vjp_inputs

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

FIELDS = ("q_dec", "k_end", "decay", "P", "W", "U")


def chunk_inputs(seed, L, C, K, V, dtype, strong=False, decay="head"):
  """q (scaled), k (unit rows), v [L, C, ...] in dtype; g [L, C] (decay "head") or [L, C, K] ("channel"), beta
  [L, C] float32. `strong`: a total forgetting (-1e4) and a strong decay early in each chunk, then decays close
  to 1, where a difference of cumulative sums would lose the weak ones; per key channel, the total forgetting
  in every other channel, and another in a quarter of the channels after the middle of the chunk (a span that
  crosses sub-chunks)."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(L, C, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q, v = rng.normal(size=(L, C, K)) * K**-0.5, rng.normal(size=(L, C, V))
  G = (L, C) if decay == "head" else (L, C, K)
  g = np.log(rng.uniform(0.5, 1.0, G))
  if strong:
    g[:, C // 2:] = np.log(rng.uniform(0.999, 1.0, (L, C - C // 2) + G[2:]))
    if decay == "head":
      g[:, 1], g[:, 3] = -1e4, -30.0
    else:
      g[:, 1, ::2], g[:, 3], g[:, C // 2 + C // 4, 1::4] = -1e4, -30.0, -1e4
  beta = rng.uniform(0, 2, (L, C))
  return ([jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(x, jnp.float32) for x in (g, beta)])


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def jitted(f, **kw):
  """`f` with keyword arguments `kw`, jitted: one compile instead of the many eager steps of the XLA reference
  (and of the interpreted kernel's surroundings)."""
  return jax.jit(functools.partial(f, **kw))


def vjp_jitted(f, args, seed):
  """(f's VJP at `args` for random cotangents of a normal's draws from `seed`, jitted, as a function of them; the
  cotangents), the cotangents' shapes from `jax.eval_shape` (no eager pass)."""
  rng = np.random.default_rng(seed)
  cts = tuple(jnp.asarray(rng.normal(size=o.shape), o.dtype) for o in jax.eval_shape(f, *args))
  return jax.jit(lambda a, c: jax.vjp(f, *a)[1](c)), cts


# (L, C, K, V, strong): K != V, several chunks, C padded (8 -> 16) and K, V padded (5, 19 -> 16, 32), one and
# several sub-chunk merge levels (C = 32, 64); blocks of 64 keys and 32 values, so K = 128 and V = 48, 64 take
# two steps of the kernel's loops.
CHUNK_CASES = [(3, 64, 32, 48, False), (2, 64, 128, 16, True), (4, 8, 5, 19, False), (2, 32, 16, 64, True)]


@pytest.mark.parametrize("L, C, K, V, strong", CHUNK_CASES)
def test_float32_equals_intra_chunk(L, C, K, V, strong):
  args = chunk_inputs(0, L, C, K, V, jnp.float32, strong)
  kw = dict(beta_kind="head", prec=jax.lax.Precision.HIGHEST)
  want = jitted(intra_chunk.local, **kw)(*args, None)
  got = jitted(pallas_local.local, block_k=64, block_v=32, **kw)(*args, None)
  assert got.A is None and got.k_dec is None  # what the fused path leaves out
  for n in FIELDS:
    a, b = getattr(got, n), getattr(want, n)
    assert a.shape == b.shape and a.dtype == b.dtype, n
    assert rel_err(a, b) <= 1e-5, (n, rel_err(a, b))


def test_bfloat16_equals_intra_chunk():
  args = chunk_inputs(1, 3, 64, 32, 48, jnp.bfloat16, strong=True)
  kw = dict(beta_kind="head", prec=jax.lax.Precision.DEFAULT)
  want, got = jitted(intra_chunk.local, **kw)(*args, None), jitted(pallas_local.local, **kw)(*args, None)
  for n in FIELDS:
    assert getattr(got, n).dtype == getattr(want, n).dtype, n
    assert rel_err(getattr(got, n), getattr(want, n)) <= 2e-2, (n, rel_err(getattr(got, n), getattr(want, n)))


def _kernel_dots(jaxpr):
  """The (lhs, rhs) operand avals of every dot_general inside the pallas_calls of `jaxpr`."""
  found = []

  def walk(j, inside):
    for eqn in j.eqns:
      if inside and eqn.primitive.name == "dot_general":
        found.append(tuple(v.aval for v in eqn.invars))
      for p in eqn.params.values():
        sub = getattr(p, "jaxpr", p)
        if hasattr(sub, "eqns"):
          walk(sub, inside or eqn.primitive.name == "pallas_call")
  walk(jaxpr.jaxpr, False)
  return found


# Interpreter tests of 16-bit fields computed two ways: equal on the CPU; run on a GPU ("gpu or not gpu"), XLA's
# float32 dots at DEFAULT precision are TF32, so an entry may land one bfloat16 rounding (2**-8 of the largest) away.
ONE_ROUNDING = 1e-3 if jax.default_backend() == "cpu" else 2.0 ** -8


@pytest.mark.parametrize("lowp", [False, True])
def test_lowp_wu_takes_16_bit_operands_and_the_xla_stages_values(monkeypatch, lowp):
  """`LOWP_WU`: the kernel's two products with T ([Cp, Cp] on the left) read bfloat16 operands with it and float32
  without; with it, W and U are XLA's stage's (`intra_chunk.LOWP_SOLVE`, on: the same roundings)."""
  monkeypatch.setattr(pallas_local, "LOWP_WU", lowp)
  monkeypatch.setattr(intra_chunk, "LOWP_SOLVE", True)
  args = chunk_inputs(1, 3, 64, 32, 16, jnp.bfloat16, strong=True)  # K 32, V 16: not the merges' [64, 64]
  kw = dict(beta_kind="head", prec=jax.lax.Precision.DEFAULT)
  f = jitted(pallas_local.local, **kw)
  dots = _kernel_dots(jax.make_jaxpr(f)(*args, None))
  t_dots = [d for d in dots if d[0].shape == (64, 64) and d[1].shape in ((64, 32), (64, 16))]  # T @ [Cp, K], [Cp, V]
  assert len(t_dots) == 2, t_dots
  want_dtype = jnp.bfloat16 if lowp else jnp.float32
  assert all(a.dtype == want_dtype and b.dtype == want_dtype for a, b in t_dots), t_dots
  want, got = jitted(intra_chunk.local, **kw)(*args, None), f(*args, None)
  errs = {n: rel_err(getattr(got, n), getattr(want, n)) for n in FIELDS}
  # With it the stage's roundings: here the same values on the CPU (1e-3 leaves room for an entry where the two
  # float32 inverses round to neighbouring bfloat16 values); without it U is 4.7e-3 away in this case. Run on a
  # GPU, the interpreter's and XLA's float32 dots are TF32 in different orders: one bfloat16 rounding apart.
  assert max(errs.values()) <= (ONE_ROUNDING if lowp else 2e-2), errs


@pytest.mark.parametrize("dtype, lowp, L, C, K, V", [("float32", False, 4, 8, 5, 19),
                                                   ("float32", False, 2, 64, 128, 16),
                                                   ("bfloat16", False, 3, 64, 32, 48),
                                                   ("bfloat16", True, 3, 64, 32, 48)])
def test_split_kernels_equal_the_one_kernel(monkeypatch, dtype, lowp, L, C, K, V):
  """`LOCAL_SPLIT`'s three kernels give the one kernel's fields to float32 rounding (T by block forward substitution
  in place of the merges, through memory in the dtype its products read), padded shapes and two steps of the key
  loop included."""
  monkeypatch.setattr(pallas_local, "LOWP_WU", lowp)
  args = chunk_inputs(4, L, C, K, V, jnp.dtype(dtype), strong=True)
  prec = jax.lax.Precision.HIGHEST if dtype == "float32" else jax.lax.Precision.DEFAULT
  f = lambda: jitted(pallas_local.local, beta_kind="head", prec=prec, block_k=64, block_v=32)  # traced anew
  one = f()(*args, None)
  monkeypatch.setattr(pallas_local, "LOCAL_SPLIT", True)
  assert "gdn_chunk_local_solve" in str(jax.make_jaxpr(f())(*args, None))
  split = f()(*args, None)
  # float32 rounding; on a GPU in bfloat16, one rounding (U 1.7e-3 apart there, H100, 2026-12-06)
  tol = 1e-6 if dtype == "float32" or jax.default_backend() == "cpu" else ONE_ROUNDING
  for n in FIELDS:
    assert getattr(split, n).dtype == getattr(one, n).dtype, n
    assert rel_err(getattr(split, n), getattr(one, n)) <= tol, (n, rel_err(getattr(split, n), getattr(one, n)))


def test_gradients_are_the_xla_references():
  """The custom VJP's backward is the VJP of `intra_chunk.local`: equal gradients for the same cotangents."""
  args = chunk_inputs(2, 2, 16, 16, 32, jnp.float32)
  kw = dict(beta_kind="head", prec=jax.lax.Precision.HIGHEST)
  pick = lambda loc: (loc.q_dec, loc.k_end, loc.decay, loc.P, loc.W, loc.U)
  vjp_ref, cts = vjp_jitted(lambda *a: pick(intra_chunk.local(*a, None, **kw)), args, 3)
  vjp_got, _ = vjp_jitted(lambda *a: pick(pallas_local.local(*a, None, **kw)), args, 3)
  for name, a, b in zip("q k v g beta".split(), vjp_got(args, cts), vjp_ref(args, cts)):
    assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def _stage_grads(args, prec, interpret=True, seed=8, split=False):
  """(kernel's, reference's) gradients of the stage's five kernel outputs for random cotangents; `split`: the two
  kernels of BACKWARD_SPLIT (the second over blocks of 16 keys)."""
  vjp, cts = vjp_jitted(lambda *a: pallas_local.reference(prec, *a), args, seed)
  cfg = pallas_local.Config(prec=pallas_local.kernel_precision(prec, interpret), ref_prec=prec, block_k=64,
                            block_v=64, interpret=interpret, num_warps=4, num_stages=1, bwd_kernel=True,
                            bwd_block_k=16, bwd_block_v=32, bwd_split=split, split_block_k=16)
  got = jax.jit(lambda *a: pallas_local.backward_kernel(cfg, *a[:5], a[5:]))(*args, *cts)
  return got, vjp(args, cts)


# (L, C, K, V, strong): as CHUNK_CASES, with the backward's blocks of 16 keys and 32 values (several loop steps);
# `strong` puts a total forgetting (-1e4), -30, then decays within 1e-3 of 1 in each chunk.
# `split`: BACKWARD_SPLIT's two kernels in place of the one.
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("L, C, K, V, strong", [(2, 64, 32, 48, True), (3, 8, 5, 19, False), (2, 32, 16, 64, True)])
def test_backward_kernel_float32_equals_vjp(L, C, K, V, strong, split):
  args = chunk_inputs(9, L, C, K, V, jnp.float32, strong)
  got, want = _stage_grads(args, jax.lax.Precision.HIGHEST, split=split)
  for name, a, b in zip("q k v g beta".split(), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("split", [False, True])
def test_backward_kernel_bfloat16_equals_vjp(split):
  args = chunk_inputs(10, 2, 64, 32, 48, jnp.bfloat16, strong=True)
  got, want = _stage_grads(args, jax.lax.Precision.DEFAULT, split=split)
  for name, a, b in zip("q k v g beta".split(), got, want):
    assert a.dtype == b.dtype, name
    assert rel_err(a, b) <= 2e-2, (name, rel_err(a, b))


def test_backward_switch_runs_the_kernels(monkeypatch):
  """BACKWARD_KERNEL on: the differentiated stage runs the forward and backward kernels (no XLA reference)."""
  monkeypatch.setattr(pallas_local, "BACKWARD_KERNEL", True)
  monkeypatch.setattr(pallas_local, "reference", None)  # would fail if called
  args = chunk_inputs(11, 1, 16, 16, 16, jnp.float32)
  f = lambda *a: pallas_local.local(*a, None, beta_kind="head", prec=jax.lax.Precision.HIGHEST).W.sum()
  grads = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(*args)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_other_variants_fall_back_to_xla():
  """Segment masks, per-key-channel decay and no beta go to `intra_chunk.local` (A set), raising nothing."""
  q, k, v, g, beta = chunk_inputs(4, 2, 16, 16, 16, jnp.float32)
  kw = dict(prec=jax.lax.Precision.HIGHEST)
  g_channel = jnp.broadcast_to(g[..., None], k.shape)
  for args, beta_kind in [((q, k, v, g_channel, beta), "head"), ((q, k, v, g, None), "none")]:
    got = jitted(pallas_local.local, beta_kind=beta_kind, **kw)(*args, None)
    want = jitted(intra_chunk.local, beta_kind=beta_kind, **kw)(*args, None)
    assert all(rel_err(getattr(got, n), getattr(want, n)) == 0 for n in ("q_dec", "P", "U"))
  assert not pallas_local.supports(g, beta, (None,), "head", jnp.float32)


def _fused_op(monkeypatch, x, chunk_size, backward_kernel=False, split=False):
  """Forward, final state and all gradients of `gated_delta_rule(method="pallas")` with FUSED_LOCAL on (a jit of
  its own: the switch is read at trace time), and pallas_local.BACKWARD_KERNEL and BACKWARD_SPLIT as asked."""
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  monkeypatch.setattr(pallas_local, "BACKWARD_KERNEL", backward_kernel)
  monkeypatch.setattr(pallas_local, "BACKWARD_SPLIT", split)
  if backward_kernel:
    monkeypatch.setattr(pallas_local, "reference", None)  # the stage's XLA forward and VJP must not run
  diff, seg, co = vjp_inputs(x)

  op = lambda d: ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                      segment_ids=seg, method="pallas", chunk_size=chunk_size)

  def f(diff):
    (o, S), vjp = jax.vjp(op, diff)
    (grads,) = vjp((co[0].astype(o.dtype), co[1].astype(S.dtype)))
    return grads

  # The kernel runs in forward-only calls; a differentiated call's forward is XLA's (pallas_local's custom_vjp),
  # or with BACKWARD_KERNEL the forward kernel, then the backward kernel.
  o, S = jax.jit(op)(diff)
  grads = jax.jit(f)(diff)
  return (np.asarray(o, np.float64), np.asarray(S, np.float64),
          {n: np.asarray(g, np.float64) for n, g in grads.items()})


# The backward through XLA's VJP, the backward kernel, or BACKWARD_SPLIT's two kernels.
BACKWARDS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("backward_kernel, split", BACKWARDS)
def test_fused_op_float32_against_oracle(monkeypatch, backward_kernel, split):
  """T = 40 over chunks of 16 (three chunks, the last padded), grouped heads, K != V, odd V, an initial state."""
  x = make_inputs(31 + 4 * backward_kernel, 2, 40, 1, 2, 16, 19, "head", "head")
  assert_close(_fused_op(monkeypatch, x, 16, backward_kernel=backward_kernel, split=split), oracle(x), 1e-5,
               f"pallas with the fused chunk-local kernel (backward kernel {backward_kernel}, split {split})")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_vjp_op_against_oracle(monkeypatch, dtype):
  """`SPLIT_VJP` with `LOCAL_SPLIT` (and `LOWP_WU` in bfloat16): a differentiated call runs the three kernels and
  `intra_chunk.local_vjp` from the inputs and T, never the XLA stage; outputs and every gradient against the
  float64 recurrence (the shapes of the two tests above)."""
  for name, value in (("LOCAL_SPLIT", True), ("SPLIT_VJP", True), ("LOWP_WU", dtype == "bfloat16"),
                      ("reference", None)):  # the stage's XLA forward and VJP must not run
    monkeypatch.setattr(pallas_local, name, value)
  if dtype == "float32":
    x = make_inputs(31, 2, 40, 1, 2, 16, 19, "head", "head")
    assert_close(_fused_op(monkeypatch, x, 16), oracle(x), 1e-5, "pallas, the split kernels and their VJP")
  else:
    x_bf, x_ref = bfloat16_inputs(make_inputs(32, 1, 48, 2, 2, 16, 16, "head", "head"))
    assert_close(_fused_op(monkeypatch, x_bf, 16), oracle(x_ref), 2e-2, "bf16 pallas, the split kernels and VJP")


@pytest.mark.parametrize("backward_kernel, split", BACKWARDS)
def test_fused_op_bfloat16_against_oracle(monkeypatch, backward_kernel, split):
  x_bf, x_ref = bfloat16_inputs(make_inputs(32 + 4 * backward_kernel, 1, 48, 2, 2, 16, 16, "head", "head"))
  assert_close(_fused_op(monkeypatch, x_bf, 16, backward_kernel=backward_kernel, split=split), oracle(x_ref), 2e-2,
               f"bf16 pallas with the fused kernel (backward kernel {backward_kernel}, split {split})")


@pytest.mark.parametrize("split", [False, True])
def test_backward_kernel_lowers_to_triton(monkeypatch, split):
  """With BACKWARD_KERNEL the differentiated stage lowers to Triton kernels for CUDA, the forward's and the
  backward's, or with BACKWARD_SPLIT the backward's two (bfloat16 at C = 64, K = V = 128)."""
  monkeypatch.setattr(pallas_local, "BACKWARD_KERNEL", True)
  monkeypatch.setattr(pallas_local, "BACKWARD_SPLIT", split)
  args = chunk_inputs(12, 2, 64, 128, 128, jnp.bfloat16)
  pick = lambda loc: (loc.q_dec, loc.k_end, loc.P, loc.W, loc.U)
  stage = lambda *a: pick(pallas_local.local(*a, None, beta_kind="head", prec=jax.lax.Precision.DEFAULT,
                                             interpret=False))

  def f(*a):
    outs, vjp = jax.vjp(stage, *a)
    return vjp(outs)

  hlo = cuda_hlo(jax.jit(f), *args)
  names = ["gdn_chunk_local_bwd_solve", "gdn_chunk_local_bwd_dqk"] if split else ["gdn_chunk_local_bwd\""]
  assert hlo.count("__gpu$xla.gpu.triton") == 1 + len(names) and all(n in hlo for n in names), names


@pytest.mark.parametrize("lowp", [False, True])  # with it, LOCAL_SPLIT too
def test_kernel_lowers_to_triton(monkeypatch, lowp):
  """The compiled path lowers for CUDA (Triton IR from the kernel body: no primitive the Triton lowering lacks),
  with and without `LOWP_WU`, the one kernel and `LOCAL_SPLIT`'s three."""
  monkeypatch.setattr(pallas_local, "LOWP_WU", lowp)
  monkeypatch.setattr(pallas_local, "LOCAL_SPLIT", lowp)
  args = chunk_inputs(5, 2, 64, 128, 128, jnp.bfloat16)
  f = jax.jit(lambda *a: pallas_local.local(*a, None, beta_kind="head", prec=jax.lax.Precision.DEFAULT,
                                            interpret=False))
  hlo = cuda_hlo(f, *args)
  assert hlo.count("__gpu$xla.gpu.triton") == (3 if lowp else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_compiled_on_gpu(monkeypatch, dtype, tol, split):
  """The compiled kernel at C = 64, K = V = 128 against intra_chunk.local (max relative error per field); with
  `split`, `LOCAL_SPLIT`'s three kernels with `LOWP_WU`."""
  monkeypatch.setattr(pallas_local, "LOCAL_SPLIT", split)
  monkeypatch.setattr(pallas_local, "LOWP_WU", split)
  args = chunk_inputs(6, 256, 64, 128, 128, jnp.dtype(dtype), strong=True)
  prec = jax.lax.Precision.HIGHEST if dtype == "float32" else jax.lax.Precision.DEFAULT
  want = intra_chunk.local(*args, None, beta_kind="head", prec=prec)
  got = jax.jit(lambda *a: pallas_local.local(*a, None, beta_kind="head", prec=prec, interpret=False))(*args)
  for n in FIELDS:
    assert rel_err(getattr(got, n), getattr(want, n)) <= tol, (n, rel_err(getattr(got, n), getattr(want, n)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_compiled_op_on_gpu(monkeypatch, dtype, tol):
  """`method="pallas"` with the fused kernel compiled, against the float64 recurrence: B = 2, T = 1024, H = 4,
  K = V = 128, chunks of 64 (no segments: they would route the chunk-local work to XLA)."""
  x = x_ref = make_inputs(33, 2, 1024, 4, 4, 128, 128, "head", "head")
  if dtype == "bfloat16":
    x, x_ref = bfloat16_inputs(x)
  assert_close(_fused_op(monkeypatch, x, 64), oracle(x_ref), tol, f"gpu pallas fused local {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_compiled_backward_on_gpu(dtype, tol, split):
  """The compiled backward kernel (or BACKWARD_SPLIT's two) at C = 64, K = V = 128 against jax.vjp of
  intra_chunk.local."""
  args = chunk_inputs(13, 256, 64, 128, 128, jnp.dtype(dtype), strong=True)
  prec = jax.lax.Precision.HIGHEST if dtype == "float32" else jax.lax.Precision.DEFAULT
  got, want = _stage_grads(args, prec, interpret=False, split=split)
  for name, a, b in zip("q k v g beta".split(), got, want):
    assert rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_compiled_op_with_backward_kernel_on_gpu(monkeypatch, dtype, tol):
  """As test_compiled_op_on_gpu, with BACKWARD_KERNEL on."""
  x = x_ref = make_inputs(37, 2, 1024, 4, 4, 128, 128, "head", "head")
  if dtype == "bfloat16":
    x, x_ref = bfloat16_inputs(x)
  assert_close(_fused_op(monkeypatch, x, 64, backward_kernel=True), oracle(x_ref), tol,
               f"gpu pallas fused local forward and backward {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_compiled_op_with_split_vjp_on_gpu(monkeypatch, dtype, tol):
  """As test_compiled_op_on_gpu, with LOCAL_SPLIT and SPLIT_VJP on (and LOWP_WU in bfloat16)."""
  for name, value in (("LOCAL_SPLIT", True), ("SPLIT_VJP", True), ("LOWP_WU", dtype == "bfloat16")):
    monkeypatch.setattr(pallas_local, name, value)
  x = x_ref = make_inputs(38, 2, 1024, 4, 4, 128, 128, "head", "head")
  if dtype == "bfloat16":
    x, x_ref = bfloat16_inputs(x)
  assert_close(_fused_op(monkeypatch, x, 64), oracle(x_ref), tol, f"gpu pallas split kernels and their VJP {dtype}")


@pytest.mark.parametrize("C, lead", [(16, (3,)), (64, (2, 3))])
def test_solve_equals_the_xla_inverse(C, lead):
  """`pallas_local.solve` (16 x 16 blocks, block forward substitution) against XLA's blocked inverse and the float64
  inverse, for strictly lower L with entries as large as Diag(beta) A's (beta up to 2, unit keys)."""
  rng = np.random.default_rng(C)
  L = np.tril(rng.uniform(-1.0, 1.0, lead + (C, C)), -1) * 0.3
  prec = jax.lax.Precision.HIGHEST
  got = jax.jit(lambda x: pallas_local.solve(x, prec, jnp.float32))(jnp.asarray(L, jnp.float32))
  xla = jax.jit(lambda x: intra_chunk._invert_unit_lower(x, prec, 16))(jnp.asarray(L, jnp.float32))
  want = np.linalg.inv(np.eye(C) + L)
  assert got.shape == L.shape and got.dtype == jnp.float32
  assert rel_err(got, want) <= 1e-5 and rel_err(got, xla) <= 1e-5, (rel_err(got, want), rel_err(got, xla))
  assert np.all(np.asarray(got)[..., np.triu_indices(C, 1)[0], np.triu_indices(C, 1)[1]] == 0)


def test_solve_lowers_to_triton():
  L = jax.ShapeDtypeStruct((2, 4, 64, 64), jnp.float32)
  hlo = cuda_hlo(jax.jit(lambda x: pallas_local.solve(x, jax.lax.Precision.DEFAULT, jnp.bfloat16, interpret=False)), L)
  assert hlo.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("decay, dtype", [("head", "float32"), ("channel", "float32"), ("head", "bfloat16")])
def test_solve_kernel_switch_in_the_xla_stage(monkeypatch, decay, dtype):
  """`intra_chunk.SOLVE_KERNEL`: the XLA chunk-local stage (`method="chunk"`) takes T's value from the kernel in
  forward-only and differentiated calls, per-head and per-key-channel decay; outputs and every gradient against the
  float64 recurrence (T = 40 over chunks of 16, the last padded)."""
  monkeypatch.setattr(intra_chunk, "SOLVE_KERNEL", True)
  x = x_ref = make_inputs(41, 1, 40, 2, 2, 16, 16, decay, "head")
  if dtype == "bfloat16":
    x, x_ref = bfloat16_inputs(x)
  diff, seg, co = vjp_inputs(x)
  op = lambda d: ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                      segment_ids=seg, method="chunk", chunk_size=16)

  def f(diff):
    (o, S), vjp = jax.vjp(op, diff)
    return o, S, vjp((co[0].astype(o.dtype), co[1].astype(S.dtype)))[0]

  assert "gdn_chunk_local_solve" in str(jax.make_jaxpr(f)(diff))
  o, S, grads = jax.jit(f)(diff)
  got = (np.asarray(o, np.float64), np.asarray(S, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()})
  assert_close(got, oracle(x_ref), 1e-5 if dtype == "float32" else 2e-2, f"chunk, SOLVE_KERNEL, {decay} {dtype}")


def test_default_uses_the_kernel_only_where_it_compiles(monkeypatch):
  """FUSED_LOCAL None: the fused kernel where the Pallas kernels compile, XLA's chunk-local work in the
  interpreter (CPU); True forces the kernel (interpreted here)."""
  calls = []
  real = pallas_local.local
  monkeypatch.setattr(pallas_local, "local", lambda *a, **kw: calls.append(kw.get("interpret")) or real(*a, **kw))
  x = make_inputs(34, 1, 32, 1, 1, 16, 16, "head", "head")
  run = lambda: jitted(ops.gated_delta_rule, method="pallas", chunk_size=16)(x["q"], x["k"], x["v"], x["g"], x["beta"])
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", None)
  want = run()[0]
  assert calls == ([] if pallas_chunk.default_interpret() else [None])
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  got = run()[0]
  assert calls[-1:] == [None]
  assert rel_err(got, want) <= 1e-5
