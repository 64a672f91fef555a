"""The diagonal sub-chunk kernels of the exact per-key-channel stage (`pallas_diag`, switch
`intra_chunk.CHANNEL_DIAG_KERNEL`): forward and backward against the pairwise float64 reference, and the op with
them against the float64 recurrence.

On CPU the kernels run in Pallas' interpreter, so the shapes are small; the `gpu` test runs them compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.ops import intra_chunk, pallas_diag
from lowering import cuda_hlo
from test_ops import assert_close, bfloat16_inputs, make_inputs, oracle, run
from test_pallas_local import rel_err

pytestmark = pytest.mark.usefixtures("fast_compile")


def _inputs(seed, lead, C, K, strong, dtype=jnp.float32):
  """q, k, g [*lead, C, K]; `strong` puts total forgettings (-1e4) at a tenth of the (position, channel)s."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=lead + (C, K))
  k = rng.normal(size=lead + (C, K)) / np.sqrt(K)
  g = np.log(rng.uniform(0.5, 1.0, lead + (C, K)))
  if strong:
    g = np.where(rng.uniform(size=g.shape) < 0.1, -1e4, g)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, g))


def _by_loops(q, k, g):
  """A and P of one sub-chunk [SUB, K] by the definition, pair by pair, in float64 NumPy."""
  q, k, g = (np.asarray(x, np.float64) for x in (q, k, g))
  c = k.shape[0]
  A, P = np.zeros((c, c)), np.zeros((c, c))
  for t in range(c):
    for j in range(t + 1):
      e = np.exp(g[j + 1:t + 1].sum(0))
      P[t, j] = (q[t] * k[j] * e).sum()
      A[t, j] = (k[t] * k[j] * e).sum() if t > j else 0.0
  return A, P


def test_reference_is_the_definition():
  with jax.enable_x64(True):
    q, k, g = _inputs(0, (1,), 32, 8, strong=True, dtype=jnp.float64)
    A, P = pallas_diag.reference(q, k, g)
  for m in range(2):
    want = _by_loops(*(x[0, 16 * m:16 * (m + 1)] for x in (q, k, g)))
    assert rel_err(A[0, m], want[0]) < 1e-12 and rel_err(P[0, m], want[1]) < 1e-12


# (lead, C, K, strong): two sub-chunks; K padded (20 -> 32) with total forgettings; four sub-chunks, two lead axes.
CASES = [((2,), 32, 16, False), ((3,), 16, 20, True), ((1, 2), 64, 32, True)]


@pytest.fixture(params=[(False, False), (True, False), (True, True)], ids=["scans", "running", "two loops"])
def running(request, monkeypatch):
  """Both ways of forming the exponents (`pallas_diag.RUNNING_SUMS`), and the backward's second loop over the rows
  (`BWD_ROW_LOOP`)."""
  monkeypatch.setattr(pallas_diag, "RUNNING_SUMS", request.param[0])
  monkeypatch.setattr(pallas_diag, "BWD_ROW_LOOP", request.param[1])
  return request.param


@pytest.mark.parametrize("lead, C, K, strong", CASES)
def test_forward_and_backward_equal_the_float64_reference(running, lead, C, K, strong):
  q, k, g = _inputs(1, lead, C, K, strong)
  rng = np.random.default_rng(2)
  shape = lead + (C // 16, 16, 16)
  cts = tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
  (A, P), vjp = jax.vjp(lambda *a: pallas_diag.diag_blocks(*a, True), q, k, g)
  grads = jax.jit(vjp)(cts)
  with jax.enable_x64(True):
    x64 = tuple(x.astype(jnp.float64) for x in (q, k, g))
    (A0, P0), vjp0 = jax.vjp(pallas_diag.reference, *x64)
    grads0 = vjp0(tuple(c.astype(jnp.float64) for c in cts))
  assert A.dtype == P.dtype == jnp.float32 and A.shape == P.shape == shape
  assert rel_err(A, A0) < 1e-6 and rel_err(P, P0) < 1e-6, (rel_err(A, A0), rel_err(P, P0))
  for name, a, b, x in zip("qkg", grads, grads0, (q, k, g)):
    assert a.dtype == x.dtype and np.isfinite(np.asarray(a)).all()
    assert rel_err(a, b) < 2e-6, (name, rel_err(a, b))


@pytest.mark.parametrize("block_k, bwd_block_k", [(16, 16), (None, 16), (32, None)])
def test_key_slices_equal_the_float64_reference(monkeypatch, block_k, bwd_block_k):
  """Programs over (sub-chunk, slice of keys) (`BLOCK_K`, `BWD_BLOCK_K`): the forward's partial blocks summed, the
  backward's slices independent; K = 20 padded to 32, with total forgettings."""
  monkeypatch.setattr(pallas_diag, "RUNNING_SUMS", True)
  monkeypatch.setattr(pallas_diag, "BLOCK_K", block_k)
  monkeypatch.setattr(pallas_diag, "BWD_BLOCK_K", bwd_block_k)
  q, k, g = _inputs(5, (2,), 32, 20, strong=True)
  cts = tuple(jnp.asarray(np.random.default_rng(6).normal(size=(2, 2, 16, 16)), jnp.float32) for _ in range(2))
  (A, P), vjp = jax.vjp(lambda *a: pallas_diag.diag_blocks(*a, True), q, k, g)
  grads = jax.jit(vjp)(cts)
  with jax.enable_x64(True):
    (A0, P0), vjp0 = jax.vjp(pallas_diag.reference, *(x.astype(jnp.float64) for x in (q, k, g)))
    grads0 = vjp0(tuple(c.astype(jnp.float64) for c in cts))
  assert rel_err(A, A0) < 1e-6 and rel_err(P, P0) < 1e-6, (rel_err(A, A0), rel_err(P, P0))
  for name, a, b in zip("qkg", grads, grads0):
    assert rel_err(a, b) < 2e-6, (name, rel_err(a, b))


def test_a_key_block_must_be_a_power_of_two(monkeypatch):
  monkeypatch.setattr(pallas_diag, "BLOCK_K", 24)
  q, k, g = _inputs(7, (1,), 16, 64, strong=False)
  with pytest.raises(ValueError, match="power of two >= 16, got 24"):
    pallas_diag.diag_blocks(q, k, g, True)


def test_bfloat16_inputs_give_bfloat16_cotangents():
  q, k, g = _inputs(3, (2,), 32, 16, strong=False, dtype=jnp.bfloat16)
  (A, P), vjp = jax.vjp(lambda *a: pallas_diag.diag_blocks(*a, True), q, k, g)
  dq, dk, dg = vjp((jnp.ones_like(A), jnp.ones_like(P)))
  assert (dq.dtype, dk.dtype, dg.dtype) == (jnp.bfloat16,) * 3
  with jax.enable_x64(True):
    A0, P0 = pallas_diag.reference(*(x.astype(jnp.float64) for x in (q, k, g)))
  assert rel_err(A, A0) < 1e-6 and rel_err(P, P0) < 1e-6  # float32 work on the bfloat16 values


def test_dyadic_stage_with_the_kernel_equals_xla(monkeypatch):
  """`intra_chunk.channel_pairs` (the dyadic form) with the kernel's diagonal blocks against its own levels: the
  same A and P."""
  q, k, g = _inputs(4, (3,), 64, 16, strong=True)
  pairs = lambda: lambda *a: intra_chunk.channel_pairs(*a, jax.lax.Precision.HIGHEST)  # traced anew each time
  monkeypatch.setattr(intra_chunk, "CHANNEL_DIAG_KERNEL", False)
  want = jax.jit(pairs())(q, k, g)
  monkeypatch.setattr(intra_chunk, "CHANNEL_DIAG_KERNEL", True)
  assert "gdn_channel_diag_blocks" in str(jax.make_jaxpr(pairs())(q, k, g))
  got = jax.jit(pairs())(q, k, g)
  for a, b in zip(got, want):
    assert rel_err(a, b) < 1e-6


def _kda(seed, T, H, HV, K, V, strong):
  x = make_inputs(seed, 2, T, H, HV, K, V, "channel", "head")
  if strong:
    x["g"][:, T // 3, :, ::2] = -1e4
    x["g"][:, T // 2, 1:, 1::3] = -30.0
  return x


# (T, chunk, H, HV, K, V, strong): the last chunk padded, grouped value heads, K != V and K padded.
OP_CASES = [(40, 16, 1, 2, 16, 19, False), (70, 32, 1, 2, 20, 16, True)]


@pytest.mark.parametrize("T, C, H, HV, K, V, strong", OP_CASES)
def test_op_with_the_kernel_against_oracle(monkeypatch, T, C, H, HV, K, V, strong):
  """`method="chunk"` with the kernel in its forward and backward: output, final state and every gradient."""
  monkeypatch.setattr(intra_chunk, "CHANNEL_DIAG_KERNEL", True)
  x = _kda(5, T, H, HV, K, V, strong)
  got = run("chunk", x, chunk_size=C, switches=(("CHANNEL_DIAG_KERNEL", True),))
  assert_close(got, oracle(x), 1e-5, "chunk with the diagonal-block kernel")


def test_op_with_the_kernel_and_segments_against_oracle(monkeypatch):
  """Packed sequences: the segment masks cut the kernel's blocks as they cut XLA's."""
  monkeypatch.setattr(intra_chunk, "CHANNEL_DIAG_KERNEL", True)
  x = make_inputs(7, 2, 48, 1, 1, 16, 16, "channel", "head", segments=True)
  got = run("chunk", x, chunk_size=16, switches=(("CHANNEL_DIAG_KERNEL", True), ("segments", True)))
  assert_close(got, oracle(x), 1e-5, "chunk with the diagonal-block kernel and segments")


def test_op_with_the_kernel_bfloat16_against_oracle(monkeypatch):
  monkeypatch.setattr(intra_chunk, "CHANNEL_DIAG_KERNEL", True)
  x_bf, x_ref = bfloat16_inputs(_kda(6, 48, 2, 2, 16, 16, strong=True))
  got = run("chunk", x_bf, chunk_size=16, switches=(("CHANNEL_DIAG_KERNEL", True),))
  assert_close(got, oracle(x_ref), 2e-2, "bf16 chunk with the diagonal-block kernel")


def test_default_is_off_on_cpu():
  assert intra_chunk.CHANNEL_DIAG_KERNEL is None and not pallas_diag.use(None)
  assert not pallas_diag.supported(8, jnp.float32) and not pallas_diag.supported(64, jnp.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_lower_to_triton(running, dtype):
  """Both kernels lower for CUDA at C = 64, K = 128."""
  q, k, g = _inputs(7, (2,), 64, 128, strong=False, dtype=jnp.dtype(dtype))
  ones = jnp.ones((2, 4, 16, 16), jnp.float32)
  def f(q, k, g):  # the forward's outputs returned too: an unused kernel op is dropped from the lowering
    out, vjp = jax.vjp(lambda *a: pallas_diag.diag_blocks(*a, False), q, k, g)
    return out, vjp((ones, ones))

  f = jax.jit(f)
  hlo = cuda_hlo(f, q, k, g)
  assert hlo.count("__gpu$xla.gpu.triton") == 2, hlo.count("__gpu$xla.gpu.triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_on_gpu(running, dtype):
  """The compiled kernels at 512 sub-chunks of K = 128 against the float64 reference, forward and backward."""
  q, k, g = _inputs(8, (128,), 64, 128, strong=True, dtype=jnp.dtype(dtype))
  rng = np.random.default_rng(9)
  cts = tuple(jnp.asarray(rng.normal(size=(128, 4, 16, 16)), jnp.float32) for _ in range(2))
  (A, P), vjp = jax.vjp(lambda *a: pallas_diag.diag_blocks(*a, False), q, k, g)
  grads = jax.jit(vjp)(cts)
  with jax.enable_x64(True):
    (A0, P0), vjp0 = jax.vjp(pallas_diag.reference, *(x.astype(jnp.float64) for x in (q, k, g)))
    grads0 = vjp0(tuple(c.astype(jnp.float64) for c in cts))
  tol = 1e-5 if dtype == "float32" else 1e-2  # bfloat16: the cotangents come back rounded
  assert rel_err(A, A0) < 1e-5 and rel_err(P, P0) < 1e-5
  for a, b in zip(grads, grads0):
    assert rel_err(a, b) < tol
