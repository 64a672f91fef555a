"""Scan over layers and rematerialisation: the scanned stack is the unrolled one, computed differently.

Same seed, same parameters (stack_layers maps one layout onto the other); the same logits, gradients, prefill,
decoding and generation; remat policies change memory, not gradients; FSDP never splits the stacked layer axis;
context parallelism runs the scan; an unrolled checkpoint is refused by a scanned model.

Shapes: B batch, T time, G scanned groups, P pattern length, Vocab vocabulary size.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.model import LanguageModel, stack_layers, unstack_layers

VOCAB = 64


def _cfg(**kw):
  # "RA" x 2 + "R": two scanned groups of both kinds of block and a remainder. The token scan compiles fastest.
  base = dict(vocab_size=VOCAB, d_model=16, num_layers=5, pattern="RA", tie_embeddings=False,
              recurrent=RecurrentConfig(num_heads=2, head_dim=8, method="recurrent"),
              attention=AttentionConfig(num_heads=2, head_dim=8))
  return ModelConfig(**{**base, **kw})


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
  """These tests check math, not XLA's fusions: fewer optimisations compile 2-3x faster."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def _tokens(B=2, T=19, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


def _pair(**kw):
  cfg = _cfg(**kw)
  return (LanguageModel(cfg, rngs=nnx.Rngs(0)),
          LanguageModel(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0)))


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _assert_close(a, b, rtol=2e-5, atol=2e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@nnx.jit
def _loss_and_grads(model, tokens, segment_ids):
  def loss(model):
    logits = model(tokens, segment_ids=segment_ids)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logits, grads


def _grads_as_scanned(unrolled, grads):
  """The unrolled model's gradients in the scanned layout."""
  holder = nnx.merge(nnx.graphdef(unrolled), grads, nnx.state(unrolled, nnx.Not(nnx.Param)))
  return nnx.state(stack_layers(holder), nnx.Param)


def test_same_init_layout_and_conversion():
  unrolled, scanned = _pair()
  assert len(unrolled.blocks) == 5 and len(scanned.scanned_blocks) == 2 and len(scanned.remainder_blocks) == 1
  assert scanned.scanned_blocks[0].mlp_norm.weight.shape == (2, 16)
  assert [type(b.mixer).__name__ for b in scanned.remainder_blocks] == ["RecurrentMixer"]
  # The same seed gives the same parameters in both layouts, and the conversions are exact inverses.
  _assert_close(_params(stack_layers(unrolled)), _params(scanned), rtol=0, atol=0)
  _assert_close(_params(unstack_layers(scanned)), _params(unrolled), rtol=0, atol=0)
  with pytest.raises(AttributeError, match="unstack_layers"):
    scanned.blocks
  with pytest.raises(ValueError, match="already has scan_layers=True"):
    stack_layers(scanned)
  with pytest.raises(TypeError, match="LanguageModel"):
    unstack_layers(object())


def test_config_errors():
  with pytest.raises(ValueError, match="remat must be one of"):
    _cfg(remat="some")
  with pytest.raises(ValueError, match="scan_layers needs at least one whole pattern group"):
    _cfg(num_layers=3, pattern="RRRA", scan_layers=True)
  with pytest.raises(ValueError, match="scan_layers must be a bool"):
    _cfg(scan_layers=1)


def test_logits_and_gradients_match_unrolled_under_every_remat():
  """Packed segments and active dropout included: the scan hands each layer its own RNG stream, and remat's
  recomputation draws the same masks."""
  tokens = _tokens()
  seg = jnp.asarray(np.repeat([[0] * 7 + [1] * 12], 2, axis=0), jnp.int32)
  rec = dataclasses.replace(_cfg().recurrent, dropout=0.1)
  unrolled, scanned = _pair(recurrent=rec)
  logits_u, grads_u = _loss_and_grads(unrolled, tokens, seg)
  ref = _grads_as_scanned(unrolled, grads_u)
  logits_s, grads_s = _loss_and_grads(scanned, tokens, seg)
  np.testing.assert_allclose(logits_s, logits_u, rtol=2e-5, atol=2e-5)
  _assert_close(grads_s, ref)
  # Both advanced their dropout streams alike: the next call draws the same masks again.
  np.testing.assert_allclose(_loss_and_grads(scanned, tokens, seg)[0], _loss_and_grads(unrolled, tokens, seg)[0],
                             rtol=2e-5, atol=2e-5)
  for scan, remat in ((True, "dots"), (False, "full")):
    model = LanguageModel(_cfg(recurrent=rec, scan_layers=scan, remat=remat), rngs=nnx.Rngs(0))
    logits, grads = _loss_and_grads(model, tokens, seg)
    np.testing.assert_allclose(logits, logits_u, rtol=2e-5, atol=2e-5)
    _assert_close(grads if scan else _grads_as_scanned(model, grads), ref)


def test_dots_states_keeps_the_state_pass_results():
  """remat="dots_states" keeps the state pass's per-chunk states and write vectors: the backward runs the Pallas
  forward kernel no second time (with "dots" it does, once per layer), and logits and gradients are those of the
  model without remat, unrolled and scanned (`pallas`, the method it is for; the names are the chunk form's too)."""
  import sys
  sys.path.insert(0, os.path.dirname(__file__))
  from test_pallas import equations

  tokens = _tokens()
  for method in ("pallas",):
    rec = dataclasses.replace(_cfg().recurrent, method=method)
    cfg = _cfg(pattern="R", num_layers=2, recurrent=rec)
    reference = LanguageModel(cfg, rngs=nnx.Rngs(0))
    logits_ref, grads_ref = _loss_and_grads(reference, tokens, None)
    for scan in (False, True):
      model = LanguageModel(dataclasses.replace(cfg, remat="dots_states", scan_layers=scan), rngs=nnx.Rngs(0))
      logits, grads = _loss_and_grads(model, tokens, None)
      np.testing.assert_allclose(logits, logits_ref, rtol=2e-5, atol=2e-5)
      _assert_close(grads, _grads_as_scanned(reference, grads_ref) if scan else grads_ref)
  for remat, want in (("dots", 4), ("dots_states", 2)):
    model = LanguageModel(_cfg(pattern="R", num_layers=2, remat=remat,
                               recurrent=dataclasses.replace(_cfg().recurrent, method="pallas")), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens) ** 2)
    names = [e.params["name"] for e in equations(jax.make_jaxpr(jax.grad(loss))(params))]
    bwd = names.count("gdn_chunk_states_bwd") + names.count("gdn_chunk_dstates_bwd")  # either backward kernel
    assert names.count("gdn_chunk_states_fwd") == want and bwd == 2, (remat, names)


@nnx.jit
def _prefill_decode(model, tokens):
  """Two prefill pieces and a decode step from an empty cache: logits [B, T, Vocab]."""
  cache = model.init_cache(tokens.shape[0], 16)
  a, cache = model.prefill(tokens[:, :9], cache)
  b, cache = model.prefill(tokens[:, 9:13], cache)
  c, cache = model.decode_step(tokens[:, 13], cache)
  return jnp.concatenate([a, b, c], axis=1)


def test_prefill_decode_generate_and_cache_bytes():
  from gdn.generate import generate
  from gdn.memory import cache_bytes

  unrolled, scanned = _pair(remat="full")  # remat must leave the cached calls alone
  tokens = _tokens(T=14)
  outs = []
  for model in (unrolled, scanned):
    cache = model.init_cache(2, 16)
    assert sum(x.nbytes for x in jax.tree.leaves(cache)) == cache_bytes(model.cfg, 2, 16).total
    outs.append((_prefill_decode(model, tokens), generate(model, tokens[:, :5], 4, rng=None, temperature=0.0)))
  np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(outs[1][1], outs[0][1])
  # The cached forward equals the full forward.
  np.testing.assert_allclose(outs[1][0], _loss_and_grads(scanned, tokens, None)[0], rtol=2e-5, atol=2e-5)
  cache = scanned.init_cache(2, 16)
  assert jax.tree.leaves(cache[0][0])[0].shape[0] == 2  # stacked over the G = 2 groups
  with pytest.raises(ValueError, match="2 entries"):
    scanned.decode_step(tokens[:, :1], cache[:1])


@pytest.mark.filterwarnings("ignore:checkpoint")
def test_checkpoints_keep_their_layout(tmp_path):
  from gdn.train.checkpoint import Checkpoints
  from gdn.train.config import TrainConfig
  from gdn.train.optimizer import make_optimizer
  from gdn.train.step import init

  cfg = _cfg(num_layers=3)
  tx = make_optimizer(TrainConfig(steps=10, warmup_steps=1))
  ckpt = Checkpoints(str(tmp_path), keep=1)
  ckpt.save(1, init(cfg, tx, 0)[1], {"batch": 1})
  ckpt.close()
  _, template = init(dataclasses.replace(cfg, scan_layers=True), tx, 0)
  try:
    restored = Checkpoints(str(tmp_path), keep=1).restore_latest(template)
  except Exception:  # refused
    restored = None
  assert restored is None  # never handed back in the wrong layout
  # A scanned checkpoint restores into the scanned layout.
  ckpt = Checkpoints(str(tmp_path / "scanned"), keep=1)
  ckpt.save(2, template, {"batch": 2})
  ckpt.close()
  state, data_state, step = Checkpoints(str(tmp_path / "scanned"), keep=1).restore_latest(template)
  assert step == 2 and data_state == {"batch": 2}
  _assert_close(jax.tree.leaves(state.params), jax.tree.leaves(template.params), rtol=0, atol=0)


def test_stacked_axis_never_sharded():
  from jax.tree_util import DictKey

  from gdn.train.sharding import is_stacked, param_spec

  assert tuple(param_spec((8, 4, 6), 8)) == ("fsdp", None, None)
  assert tuple(param_spec((8, 4, 6), 8, stacked=True)) == ()  # only the layer axis divides: replicated
  assert tuple(param_spec((8, 16, 6), 8, stacked=True)) == (None, "fsdp", None)
  assert is_stacked((DictKey("mu"), DictKey("scanned_blocks"), DictKey(0)))
  assert not is_stacked((DictKey("remainder_blocks"), DictKey(0)))


@pytest.mark.slow
def test_sharded_and_context_parallel_on_8_devices():
  """FSDP (2 x 4) train steps of the scanned model equal one device's unrolled steps; context parallelism over
  4 devices gives the scanned model's logits."""
  from devices import run_child

  out = run_child(__file__)
  assert out["stacked_specs_ok"] and out["some_split"], out
  np.testing.assert_allclose(out["losses_scanned_8"], out["losses_unrolled_1"], rtol=1e-5)
  assert out["context_parallel_err"] < 1e-5, out


def _child():
  import json

  from jax.sharding import Mesh

  from gdn.parallel import context_parallel_apply
  from gdn.train import sharding
  from gdn.train.config import TrainConfig
  from gdn.train.optimizer import lr_shape, make_optimizer
  from gdn.train.step import init, make_train_step

  cfg = _cfg()
  scan_cfg = dataclasses.replace(cfg, scan_layers=True, remat="dots")
  train_cfg = TrainConfig(steps=10, warmup_steps=1, learning_rate=3e-3)
  tx = make_optimizer(train_cfg)
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 8, 17)).astype(np.int32)
  batches = [dict(inputs=t[:, :-1], targets=t[:, 1:], weights=np.ones((8, 16), np.float32)) for t in tokens]

  def losses(model_cfg, mesh):
    graphdef, state = init(model_cfg, tx, seed=0)
    step = make_train_step(graphdef, tx, lr_shape(train_cfg), mesh=mesh)
    if mesh is not None:
      state = jax.device_put(state, sharding.tree_shardings(state, mesh))
    out = []
    for b in batches:
      state, m = step(state, sharding.shard_batch(b, mesh) if mesh is not None else b)
      out.append(float(m["loss"]))
    return out, state

  losses_1, _ = losses(cfg, None)
  mesh = sharding.make_mesh(data=2, fsdp=4)
  losses_8, state = losses(scan_cfg, mesh)
  stacked = {jax.tree_util.keystr(p): x.sharding.spec
             for p, x in jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
             if sharding.is_stacked(p)}
  stacked_ok = bool(stacked) and all(len(s) == 0 or s[0] is None for s in stacked.values())
  some_split = any("fsdp" in str(s) for s in stacked.values())

  model = LanguageModel(scan_cfg, rngs=nnx.Rngs(0))
  t = jnp.asarray(tokens[0, :2, :16])
  seq_mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
  cp, ref = context_parallel_apply(model, t, seq_mesh, axis_name="seq"), nnx.jit(lambda m, t: m(t))(model, t)
  err = float(jnp.abs(cp - ref).max() / jnp.abs(ref).max())
  print(json.dumps(dict(losses_unrolled_1=losses_1, losses_scanned_8=losses_8, stacked_specs_ok=stacked_ok,
                        some_split=some_split, context_parallel_err=err)))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _child()
