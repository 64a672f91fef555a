"""RecurrentConfig.remat: the mixer's backward keeps less and computes the same gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.bench.residuals import residual_bytes, saved_residuals
from gdn.config import ModelConfig, RecurrentConfig, recurrent_preset
from gdn.layers.recurrent import RecurrentMixer
from gdn.model import LanguageModel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

D, H, K = 64, 2, 32


def _layer_loss(method: str, remat: str, chunk_size: int = 32):
  cfg = recurrent_preset("gated_deltanet", num_heads=H, head_dim=K, method=method, remat=remat,
                         chunk_size=chunk_size)
  graphdef, params, rest = nnx.split(RecurrentMixer(cfg, D, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, x):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

  return loss, params


def _close(a, b, rtol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    scale = float(jnp.max(jnp.abs(y))) + 1e-30
    np.testing.assert_allclose(np.asarray(x) / scale, np.asarray(y) / scale, atol=rtol, err_msg=str(path))


@pytest.mark.parametrize("method,T,chunk_size", [("chunk", 100, 32), ("pallas", 40, 16)])
def test_gradients_equal_without_remat(method, T, chunk_size):
  """float32: every remat setting gives the gradients of the plain layer (w.r.t. parameters and input) to
  float32 rounding; the Pallas path runs its kernels in interpret mode on CPU."""
  x = jax.random.normal(jax.random.key(1), (2, T, D), jnp.float32)
  grads = {}
  for remat in ("none", "features", "op", "layer"):
    loss, params = _layer_loss(method, remat, chunk_size)
    grads[remat] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  for remat in ("features", "op", "layer"):
    _close(grads[remat], grads["none"], 1e-5)


def test_kept_bytes_drop():
  """What the backward keeps (jax.vjp's residuals, from the jaxpr) drops by the factors measured at the
  benchmark shape (docs/benchmarks.md: 44.1 -> 22.3 -> 2.7 KB a token); it would not if the checkpoint were
  not applied."""
  x = jnp.zeros((2, 128, D), jnp.bfloat16)
  kept = {}
  for remat in ("none", "features", "op", "layer"):
    cfg = recurrent_preset("gated_deltanet", num_heads=H, head_dim=K, method="chunk", remat=remat)
    graphdef, params, rest = nnx.split(RecurrentMixer(cfg, D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), nnx.Param,
                                       ...)
    loss = lambda params, x: jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32))
    kept[remat] = residual_bytes(saved_residuals(loss, params, x))
  assert kept["op"] < 0.7 * kept["none"], kept
  # "features" drops the short conv's output, its SiLU's input and the q/k norm's inputs: at least the conv's
  # output [B, T, 2 H K + H K] bf16 less than "none" (the op still keeps its own q, k, v).
  tokens = x.shape[0] * x.shape[1]
  assert kept["features"] <= kept["none"] - tokens * 3 * H * K * 2, kept
  assert kept["layer"] < 0.1 * kept["none"], kept
  # "layer" keeps the four projections of x [B, T, 2 H K] bf16 and the op output, plus bf16 copies of weights.
  assert kept["layer"] <= tokens * 5 * H * K * 2 + 6 * D * H * K * 2 + 4096, kept


def test_remat_is_validated():
  with pytest.raises(ValueError, match="remat"):
    RecurrentConfig(remat="full")


@pytest.mark.parametrize("model_remat", ["none", "dots"])
def test_composes_with_model_remat_and_scan_layers(model_remat):
  """Inside the model's scanned, checkpointed blocks, the mixer's remat leaves the gradients unchanged."""
  tokens = jax.random.randint(jax.random.key(0), (2, 48), 0, 64)
  grads = {}
  for remat in ("none", "layer"):
    rc = recurrent_preset("gated_deltanet", num_heads=H, head_dim=16, method="chunk", chunk_size=16, remat=remat)
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, pattern="R", recurrent=rc, scan_layers=True,
                      remat=model_remat, mlp_ratio=0)
    graphdef, params, rest = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    loss = lambda params: jnp.mean(nnx.merge(graphdef, params, rest)(tokens) ** 2)
    grads[remat] = jax.jit(jax.grad(loss))(params)
  _close(grads["layer"], grads["none"], 1e-5)
