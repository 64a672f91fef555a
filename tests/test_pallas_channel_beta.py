"""`method="pallas"` with per-value-channel beta ([B, T, HV, V]) against the float64 recurrence.

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim, C chunk size, BV value block.

The state-pass kernel solves each chunk's write vectors per value channel (`pallas_chunk._channel_solve`, rows in
blocks of `pallas_chunk.SUB`). On CPU the kernels run in Pallas' interpreter, so the cases are few and small, each
combining several features: beta in [0, 2], grouped heads, odd K and V, T not a multiple of C, an initial state,
packed segments; C = 8 and 16 take one block of rows (C = 8 padded to 16), C = 32 two and C = 64 four, so the
blocks' matmuls are checked too. The `gpu` test runs the compiled Triton kernels at a realistic shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import pallas_chunk
from lowering import cuda_hlo
from test_ops import DIFF_ARGS, assert_close, bfloat16_inputs, make_inputs, oracle
from test_pallas import _assert_fused_close, _fwd_bwd, _gpu_inputs, equations, run_pallas

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

# (g, C, block_v, T): block_v 16 with V = 19 splits the value channels over two programs, so the per-program
# partial sums of the K- and C-side cotangents are checked too; None goes through the public method="pallas".
CASES = [
    ("head", 16, None, 35),  # Gated DeltaNet's decay
    ("channel", 8, 16, 35),  # per-key-channel decay (KDA)
    ("none", 32, 16, 35),  # no decay
    ("head", 64, 16, 70),  # four blocks of rows in a chunk
]


@pytest.mark.parametrize("g_kind, C, block_v, T", CASES)
def test_float32_against_oracle(g_kind, C, block_v, T):
  x = make_inputs(41, 1, T, 2, 4, 5, 19, g_kind, "channel", segments=True)
  got = run_pallas(x, chunk_size=C, block_v=block_v)
  assert_close(got, oracle(x), 1e-5, f"pallas channel beta g={g_kind} C={C}")


def test_without_segments_or_initial_state():
  x = make_inputs(42, 2, 37, 1, 2, 16, 16, "head", "channel", init=False)
  assert_close(run_pallas(x, chunk_size=16), oracle(x), 1e-5, "pallas channel beta, plain")


@pytest.mark.parametrize("case", ["total_forgetting", "beta_0_or_2", "identical_keys"])
def test_torture(case):
  """`test_ops.test_torture`'s hard inputs with per-value-channel beta, C = 32 (two blocks of rows)."""
  x = make_inputs(49, 1, 70, 1, 2, 8, 8, "head", "channel")
  if case == "total_forgetting":
    x["g"] = np.full_like(x["g"], -1e4)
  elif case == "beta_0_or_2":  # each channel's transition a projection, a reflection or the identity
    x["beta"] = 2.0 * (x["beta"] > 1.0).astype(np.float32)
  elif case == "identical_keys":
    x["k"] = np.broadcast_to(x["k"][:, :1], x["k"].shape).copy()
    x["g"] = np.zeros_like(x["g"])
  assert_close(run_pallas(x, chunk_size=32), oracle(x), 1e-5, f"pallas channel beta {case}")


@pytest.mark.parametrize("g_kind", ["head", "channel"])
def test_bfloat16_inputs(g_kind):
  x_bf, x_ref = bfloat16_inputs(make_inputs(43, 1, 40, 2, 2, 16, 16, g_kind, "channel", segments=True))
  assert_close(run_pallas(x_bf), oracle(x_ref), 2e-2, f"bf16 pallas channel beta g={g_kind}")


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fused_output_against_oracle(monkeypatch, dtype, tol):
  """FUSED_OUTPUT: the output inside the forward kernel (forward only), and the differentiated call."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", True)
  x = make_inputs(44, 1, 35, 1, 2, 5, 19, "head", "channel", segments=True)
  x, x_ref = bfloat16_inputs(x) if dtype == "bfloat16" else (x, x)
  _assert_fused_close(x, oracle(x_ref), tol, f"fused output channel beta {dtype}", chunk_size=32, block_v=16)


@pytest.mark.parametrize("fused_output", [False, True])
def test_forward_runs_the_kernel(monkeypatch, fused_output):
  """The forward is the Pallas state pass with the solve inside (A and beta among its operands), not XLA's chunk
  scan: its jaxpr has one pallas_call and no scan over the chunks. FUSED_LOCAL on, as on a GPU: the chunk-local
  work of this variant stays XLA's (`pallas_local` takes per-head beta only)."""
  monkeypatch.setattr(pallas_chunk, "FUSED_OUTPUT", fused_output)
  monkeypatch.setattr(pallas_chunk, "FUSED_LOCAL", True)
  x = make_inputs(45, 1, 40, 1, 2, 16, 16, "head", "channel")
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  jaxpr = jax.make_jaxpr(lambda *a: ops.gated_delta_rule(*a, method="pallas", chunk_size=16))(*args)
  (call,) = equations(jaxpr)
  # v, k_dec, k_end, decay, S0, (q_dec, P,) A, beta: two more than the per-head kernel's
  assert len(call.invars) == 7 + 2 * fused_output, [v.aval.shape for v in call.invars]
  assert not equations(jaxpr, "scan"), "the forward ran XLA's chunk scan"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_lower_to_triton(dtype):
  """The compiled path lowers for CUDA: the forward and backward state-pass kernels become Triton calls (float32
  callers: 3xTF32 dots; bfloat16 ones: bfloat16 operands). Catches what the interpreter accepts and Triton does
  not (shapes, dot layouts, ref slices) without a GPU."""
  x = make_inputs(46, 1, 64, 1, 2, 5, 19, "channel", "channel", segments=True)
  x = bfloat16_inputs(x)[0] if dtype == "bfloat16" else x
  diff = {n: jnp.asarray(x[n]) for n in DIFF_ARGS}
  co = (jnp.ones((1, 64, 2, 19)), jnp.ones((1, 2, 5, 19)))
  hlo = cuda_hlo(_fwd_bwd(tuple(sorted(diff)), 32, 16, False), diff, jnp.asarray(x["segment_ids"]), co)
  assert hlo.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, g_kind, tol", [("float32", "head", 1e-4), ("bfloat16", "head", 5e-2),
                                                ("float32", "channel", 1e-4)])
def test_compiled_on_gpu(dtype, g_kind, tol):
  """The compiled Triton kernels at a realistic shape: B = 2, T = 1024, H = 4, K = V = 128, segments, C = 64."""
  x, x_ref = _gpu_inputs(47, dtype, g_kind, "channel")
  assert_close(run_pallas(x, chunk_size=64, interpret=False), oracle(x_ref), tol,
               f"gpu pallas channel beta {dtype} g={g_kind}")
