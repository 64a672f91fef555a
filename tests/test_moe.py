"""The sparse MoE MLP: routed output equals a dense reference, the load-balancing loss, MoE hybrids train (one
device and 8 CPU devices with the experts sharded), and bad configs are refused.

The 8-device check runs in a child process started with XLA_FLAGS=--xla_force_host_platform_device_count=8 (this
file run as a script), as in test_sharding.py.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, MoEConfig, recurrent_preset
from gdn.layers.moe import MoE, load_balancing_loss
from gdn.model import LanguageModel
from devices import device_count_flags

D = 32
# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def dense_reference(moe: MoE, x):
  """Every expert on every token, weighted by the (renormalised) top-k probabilities, zero elsewhere; float64."""
  cfg = moe.cfg
  x = np.asarray(x, np.float64).reshape(-1, D)
  silu = lambda a: a / (1 + np.exp(-a))
  p = x @ np.asarray(moe.router.kernel[...], np.float64)
  p = np.exp(p - p.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, axis=-1)[:, :cfg.top_k]
  w = np.zeros_like(p)
  np.put_along_axis(w, top, np.take_along_axis(p, top, -1), -1)
  if cfg.norm_topk:
    w /= w.sum(-1, keepdims=True)
  e = moe.experts
  g, u, d = (np.asarray(a[...], np.float64) for a in (e.gate_proj, e.up_proj, e.down_proj))
  y = sum(w[:, i:i + 1] * ((silu(x @ g[i]) * (x @ u[i])) @ d[i]) for i in range(cfg.num_experts))
  if moe.shared_expert is not None:
    s = moe.shared_expert
    k = lambda lin: np.asarray(lin.kernel[...], np.float64)
    shared = (silu(x @ k(s.gate_proj)) * (x @ k(s.up_proj))) @ k(s.down_proj)
    if moe.shared_gate is not None:
      shared = shared / (1 + np.exp(-(x @ k(moe.shared_gate))))
    y = y + shared
  return y


@pytest.mark.parametrize("cfg", [MoEConfig(num_experts=4, top_k=2, hidden=16),
                                 MoEConfig(num_experts=5, top_k=3, hidden=8, shared_hidden=24, norm_topk=False),
                                 MoEConfig(num_experts=3, top_k=1, hidden=8, shared_hidden=8, shared_gate=False)])
def test_moe_equals_the_dense_reference(cfg):
  moe = MoE(cfg, D, init_std=0.3, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (3, 7, D))

  @nnx.jit
  def forward(moe, x):  # one compile is cheaper than the eager ops
    stats = []
    return moe(x, stats), stats

  y, stats = forward(moe, x)
  assert y.shape == x.shape
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), dense_reference(moe, x), rtol=2e-5, atol=2e-6)
  (f, P), = stats
  np.testing.assert_allclose(float(f.sum()), cfg.top_k, rtol=1e-6)  # each token counts once per chosen expert
  np.testing.assert_allclose(float(P.sum()), 1.0, rtol=1e-6)


def test_load_balancing_loss():
  moe = MoE(MoEConfig(num_experts=4, top_k=2, hidden=8), D, rngs=nnx.Rngs(0))
  moe.router.kernel[...] = jnp.zeros((D, 4))
  stats = []
  moe(jax.random.normal(jax.random.key(0), (2, 5, D)), stats)
  assert abs(float(load_balancing_loss(stats, 4)) - 2.0) < 1e-6  # uniform probabilities: top_k
  # Two layers: f and P averaged over layers, then E * sum f P (transformers' Qwen3-Next formula).
  stats = [(jnp.array([2.0, 0, 0, 0]), jnp.array([1.0, 0, 0, 0])),
           (jnp.array([0, 2.0, 0, 0]), jnp.array([0, 1.0, 0, 0]))]
  assert abs(float(load_balancing_loss(stats, 4)) - 4 * (1.0 * 0.5 + 1.0 * 0.5)) < 1e-6
  assert float(load_balancing_loss([], 4)) == 0.0


def moe_model_cfg(pattern="RRA", **kw):
  return ModelConfig(vocab_size=64, d_model=D, num_layers=len(pattern), pattern=pattern, mlp_pattern="MD",
                     recurrent=recurrent_preset("gated_deltanet", num_heads=2, head_dim=16, chunk_size=16),
                     attention=AttentionConfig(num_heads=2, head_dim=16),
                     moe=MoEConfig(num_experts=4, top_k=2, hidden=16, shared_hidden=16, aux_loss_coef=0.1), **kw)


def test_moe_model_layers_decoding_and_aux_loss():
  cfg = moe_model_cfg()
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  assert [type(b.mlp).__name__ for b in model.blocks] == ["MoE", "SwiGLU", "MoE"]
  model = LanguageModel(moe_model_cfg("AA"), rngs=nnx.Rngs(0))  # cheaper for the decoding check
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)

  @nnx.jit
  def run(model, tokens):
    logits, aux = model(tokens, return_aux_loss=True)
    prefill, cache = model.prefill(tokens[:, :7], model.init_cache(2, 12))
    step, _ = model.decode_step(tokens[:, 7:8], cache)
    return logits, aux, model(tokens), prefill, step

  logits, aux, plain, prefill, step = run(model, tokens)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
  assert 1.0 < float(aux) < 4.0  # top_k = 2 when balanced; routing at init is nearly uniform
  np.testing.assert_allclose(np.asarray(prefill), np.asarray(logits[:, :7]), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(logits[:, 7]), rtol=1e-4, atol=1e-5)


def test_aux_loss_is_in_the_training_loss():
  from gdn.train.config import TrainConfig
  from gdn.train.optimizer import lr_shape, make_optimizer
  from gdn.train.step import init, make_train_step

  tokens = np.random.default_rng(0).integers(0, 64, size=(2, 17)).astype(np.int32)
  batch = dict(inputs=jnp.asarray(tokens[:, :-1]), targets=jnp.asarray(tokens[:, 1:]), weights=jnp.ones((2, 16)))
  cfg = moe_model_cfg("AA")
  train_cfg = TrainConfig(steps=2, warmup_steps=1)
  tx = make_optimizer(train_cfg)
  graphdef, state = init(cfg, tx, seed=0)
  loss = float(make_train_step(graphdef, tx, lr_shape(train_cfg))(state, batch)[1]["loss"])
  logits, aux = nnx.jit(lambda m, x: m(x, return_aux_loss=True))(LanguageModel(cfg, rngs=nnx.Rngs(0)), batch["inputs"])
  logp = jax.nn.log_softmax(logits, -1)
  nll = -float(jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean())
  np.testing.assert_allclose(loss - nll, cfg.moe.aux_loss_coef * float(aux), rtol=1e-3)


def test_moe_config_errors():
  with pytest.raises(ValueError, match="top_k"):
    MoEConfig(num_experts=2, top_k=3)
  with pytest.raises(ValueError, match="mlp_pattern"):
    ModelConfig(mlp_pattern="DX")
  with pytest.raises(ValueError, match="shared_hidden"):
    MoEConfig(shared_hidden=-1)


@pytest.mark.slow
def test_moe_training_on_one_and_8_devices():
  env = dict(os.environ, XLA_FLAGS=device_count_flags(8), JAX_PLATFORMS="cpu",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # math, not XLA's fusions: fewer optimisations compile faster
  r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "moe sharded ok" in r.stdout


def _child():
  from gdn.train import sharding
  from gdn.train.config import TrainConfig
  from gdn.train.optimizer import lr_shape, make_optimizer
  from gdn.train.step import init, make_train_step

  assert jax.device_count() == 8
  cfg = moe_model_cfg("AA")
  train_cfg = TrainConfig(steps=12, warmup_steps=2, learning_rate=1e-2)
  tx = make_optimizer(train_cfg)
  rng = np.random.default_rng(0)
  t = rng.integers(0, 64, size=(8, 33)).astype(np.int32)  # one batch, seen 12 times: memorised
  batches = [dict(inputs=t[:, :-1], targets=t[:, 1:], weights=np.ones((8, 32), np.float32))] * 12
  graphdef, _ = init(cfg, tx, seed=0)
  step = make_train_step(graphdef, tx, lr_shape(train_cfg))

  def run(mesh):
    state = init(cfg, tx, seed=0)[1]
    if mesh is not None:
      state = jax.device_put(state, sharding.tree_shardings(state, mesh))
    losses = []
    for b in batches:
      batch = sharding.shard_batch(b, mesh) if mesh is not None else jax.tree.map(jnp.asarray, b)
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
    return state, np.array(losses)

  one, losses1 = run(None)
  assert losses1[-1] < 0.85 * losses1[0], losses1
  mesh = sharding.make_mesh(data=2, fsdp=4)
  many, losses8 = run(mesh)
  np.testing.assert_allclose(losses8, losses1, rtol=2e-4)
  gate = many.params["blocks"][0]["mlp"]["experts"]["gate_proj"]
  spec = tuple(gate[...].sharding.spec)
  assert spec[0] == "fsdp" and not any(spec[1:]), spec  # whole experts per device
  print("moe sharded ok")


if __name__ == "__main__":
  _child()
