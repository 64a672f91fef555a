"""The fused chunk-local kernel for a per-key-channel decay (`pallas_local._channel_kernel`, KDA, switch
`pallas_local.FUSED_LOCAL_CHANNEL`) against `intra_chunk.local`, and `method="pallas"` with it against the float64
recurrence.

Shapes: L chunks, C chunk size, K key dim, V value dim; B batch, T time, H q/k heads, HV value heads.

On CPU the kernel runs in Pallas' interpreter, so the shapes are small; the `gpu` tests run it compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import intra_chunk, pallas_chunk, pallas_local
from lowering import cuda_hlo
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle
from test_pallas import equations
from test_pallas_local import FIELDS, _fused_op, chunk_inputs, jitted, rel_err, vjp_jitted

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


@pytest.fixture
def channel_on(monkeypatch):
  monkeypatch.setattr(pallas_local, "FUSED_LOCAL_CHANNEL", True)
  # XLA's stage with the kernel's span sums (cumulative sums): a forward-only call would take the matmuls
  # (SEGSUM_MATMUL "primal"), whose other summation order moves e^{gamma_C} under the strong decay by 1.1e-5.
  monkeypatch.setattr(intra_chunk, "SEGSUM_MATMUL", False)


def _stage(args, prec, **kw):
  """(kernel's Local, intra_chunk's Local) for the per-key-channel inputs `args`, each jitted."""
  want = jitted(intra_chunk.local, beta_kind="head", prec=prec)(*args, None)
  return jitted(pallas_local.local, beta_kind="head", prec=prec, **kw)(*args, None), want


def _assert_fields(got, want, tol):
  assert got.A is None and got.k_dec is None  # what the fused path leaves out
  for n in FIELDS:
    a, b = getattr(got, n), getattr(want, n)
    assert a.shape == b.shape and a.dtype == b.dtype, n
    assert np.isfinite(np.asarray(a, np.float64)).all(), n
    assert rel_err(a, b) <= tol, (n, rel_err(a, b))


# (L, C, K, V, strong, block_k): six dyadic levels with two steps of 16 keys; two steps of 32 keys with total
# forgettings; C, K, V padded (8, 5, 19 -> 16, 16, 32: four levels); five levels; four levels with two key steps.
CASES = [(2, 64, 32, 48, False, 16), (2, 64, 64, 16, True, 32), (3, 8, 5, 19, False, None),
         (2, 32, 16, 64, True, None), (2, 16, 32, 32, True, 16)]


@pytest.mark.parametrize("L, C, K, V, strong, block_k", CASES)
def test_float32_equals_intra_chunk(channel_on, L, C, K, V, strong, block_k):
  args = chunk_inputs(20, L, C, K, V, jnp.float32, strong, decay="channel")
  _assert_fields(*_stage(args, HIGHEST, block_k=block_k), 1e-5)


@pytest.mark.parametrize("C", [64, 32])
def test_bfloat16_equals_intra_chunk(channel_on, C):
  args = chunk_inputs(21, 3, C, 32, 48, jnp.bfloat16, strong=True, decay="channel")
  _assert_fields(*_stage(args, DEFAULT, block_k=16), 2e-2)


def test_total_forgetting_everywhere(channel_on):
  """g = -1e4 at every position and channel: no e^{+x} anywhere, so every field is finite (P's and A's
  off-diagonal entries and the decays are exact zeros) and equals XLA's."""
  q, k, v, g, beta = chunk_inputs(22, 2, 64, 32, 16, jnp.float32, decay="channel")
  got, want = _stage((q, k, v, jnp.full_like(g, -1e4), beta), HIGHEST, block_k=16)
  _assert_fields(got, want, 1e-5)
  assert not np.asarray(got.decay).any() and not np.tril(np.asarray(got.P), -1).any()


def test_switch_off_falls_back_to_xla():
  """FUSED_LOCAL_CHANNEL off (the default): per-key-channel decay goes to `intra_chunk.local` (A set)."""
  assert pallas_local.FUSED_LOCAL_CHANNEL is False
  args = chunk_inputs(23, 2, 16, 16, 16, jnp.float32, decay="channel")
  assert not pallas_local.supports(args[3], args[4], None, "head", jnp.float32)
  got, want = _stage(args, HIGHEST)
  assert got.A is not None and all(rel_err(getattr(got, n), getattr(want, n)) == 0 for n in FIELDS)


def test_gradients_are_the_xla_references(channel_on, monkeypatch):
  """Differentiated, the stage runs XLA's forward and VJP: equal gradients for the same cotangents, with
  BACKWARD_KERNEL on too (the backward kernel takes a per-head decay only)."""
  monkeypatch.setattr(pallas_local, "BACKWARD_KERNEL", True)
  args = chunk_inputs(24, 2, 32, 16, 16, jnp.float32, strong=True, decay="channel")
  kw = dict(beta_kind="head", prec=HIGHEST)
  pick = lambda loc: tuple(getattr(loc, n) for n in FIELDS)
  vjp_ref, cts = vjp_jitted(lambda *a: pick(intra_chunk.local(*a, None, **kw)), args, 25)
  vjp_got, _ = vjp_jitted(lambda *a: pick(pallas_local.local(*a, None, **kw)), args, 25)
  for name, a, b in zip("q k v g beta".split(), vjp_got(args, cts), vjp_ref(args, cts)):
    assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def _kda_inputs(seed, B, T, H, HV, K, V, strong):
  """make_inputs with per-key-channel decay and per-head beta; `strong` adds total forgettings (-1e4) in some
  channels and a -30 at a few positions."""
  x = make_inputs(seed, B, T, H, HV, K, V, "channel", "head")
  if strong:
    x["g"][:, T // 3, :, ::2] = -1e4
    x["g"][:, T // 2, 1:, 1::3] = -30.0
  return x


# (T, C, H, HV, K, V, strong): T not a multiple of C (the last chunk padded), grouped value heads, K != V, odd V.
OP_CASES = [(40, 16, 1, 2, 16, 19, False), (70, 32, 1, 2, 32, 16, True), (50, 64, 2, 2, 16, 32, True)]


@pytest.mark.parametrize("T, C, H, HV, K, V, strong", OP_CASES)
def test_fused_op_float32_against_oracle(channel_on, monkeypatch, T, C, H, HV, K, V, strong):
  """Forward (the kernel), final state and gradients (XLA's stage and VJP) with an initial state."""
  x = _kda_inputs(26, 2, T, H, HV, K, V, strong)
  assert_close(_fused_op(monkeypatch, x, C), oracle(x), 1e-5, "pallas with the fused KDA chunk-local kernel")


def test_fused_op_bfloat16_against_oracle(channel_on, monkeypatch):
  x_bf, x_ref = bfloat16_inputs(_kda_inputs(27, 1, 48, 2, 2, 16, 16, strong=True))
  assert_close(_fused_op(monkeypatch, x_bf, 16), oracle(x_ref), 2e-2, "bf16 pallas with the fused KDA kernel")


def test_forward_runs_no_xla_stage(monkeypatch):
  """FUSED_LOCAL and FUSED_LOCAL_CHANNEL on: the forward's chunk-local work is the channel kernel (a pallas_call
  of its name beside the state pass's) and `intra_chunk.local` is never called; with FUSED_LOCAL_CHANNEL off the
  same call reaches it."""
  def xla_stage(*a, **kw):
    raise AssertionError("the XLA chunk-local stage ran")

  x = _kda_inputs(28, 1, 40, 1, 2, 16, 16, strong=False)
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  fwd = lambda *a: ops.gated_delta_rule(*a, initial_state=jnp.asarray(x["initial_state"]), method="pallas",
                                        chunk_size=16)
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  monkeypatch.setattr(intra_chunk, "local", xla_stage)
  with pytest.raises(AssertionError, match="XLA chunk-local stage"):
    jax.make_jaxpr(fwd)(*args)
  monkeypatch.setattr(pallas_local, "FUSED_LOCAL_CHANNEL", True)
  jaxpr = jax.make_jaxpr(fwd)(*args)
  names = sorted(e.params["name"] for e in equations(jaxpr))
  assert len(names) == 2 and "gdn_chunk_local_channel" in names, names
  o, S = jax.jit(fwd)(*args)
  o_ref, S_ref, _ = oracle(x)
  assert rel_err(o, o_ref) <= 1e-5 and rel_err(S, S_ref) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_lowers_to_triton(channel_on, dtype):
  """The compiled path lowers for CUDA (Triton IR from the kernel body: a loop over key blocks with dynamic
  slices, exact float32 span-sum dots, 16-key factor dots, masked [C, C] accumulators) at C = 64, K = V = 128,
  float32 and bfloat16."""
  args = chunk_inputs(29, 2, 64, 128, 128, jnp.dtype(dtype), decay="channel")
  prec = HIGHEST if dtype == "float32" else DEFAULT
  f = jax.jit(lambda *a: pallas_local.local(*a, None, beta_kind="head", prec=prec, interpret=False))
  hlo = cuda_hlo(f, *args)
  assert hlo.count("__gpu$xla.gpu.triton") == 1 and "gdn_chunk_local_channel" in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_compiled_on_gpu(channel_on, dtype, tol):
  """The compiled kernel at C = 64, K = V = 128 against intra_chunk.local (max relative error per field)."""
  args = chunk_inputs(30, 256, 64, 128, 128, jnp.dtype(dtype), strong=True, decay="channel")
  prec = HIGHEST if dtype == "float32" else DEFAULT
  want = intra_chunk.local(*args, None, beta_kind="head", prec=prec)
  got = jax.jit(lambda *a: pallas_local.local(*a, None, beta_kind="head", prec=prec, interpret=False))(*args)
  _assert_fields(got, want, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_compiled_op_on_gpu(channel_on, monkeypatch, dtype, tol):
  """`method="pallas"` with the KDA kernel compiled, against the float64 recurrence: B = 2, T = 1024, H = 4,
  K = V = 128, chunks of 64."""
  x = x_ref = _kda_inputs(31, 2, 1024, 4, 4, 128, 128, strong=True)
  if dtype == "bfloat16":
    x, x_ref = bfloat16_inputs(x)
  assert_close(_fused_op(monkeypatch, x, 64), oracle(x_ref), tol, f"gpu pallas fused KDA local {dtype}")
