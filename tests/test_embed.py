"""`gdn.layers.embed.embed_lookup`: the one-hot matmul gradient gives the values and gradients of nnx.Embed's
gather (whose gradient is a scatter-add), on its own, in a whole model and under vmap; it is off by default; a bad
switch value is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import ModelConfig, recurrent_preset
from gdn.layers import embed
from gdn.model import LanguageModel

pytestmark = pytest.mark.usefixtures("fast_compile")


def _tokens(key, shape, V):
  """Tokens with heavy repeats (half the positions one token, as a text's spaces), every id in range."""
  k1, k2 = jax.random.split(key)
  t = jax.random.randint(k1, shape, 0, V)
  return jnp.where(jax.random.bernoulli(k2, 0.5, shape), 3, t)


def _grad(table, tokens, dtype, ct, on, monkeypatch):
  monkeypatch.setattr(embed, "ONEHOT_GRAD", on)
  out, vjp = jax.vjp(lambda t: embed.embed_lookup(t, tokens, dtype), table)
  return out, vjp(ct.astype(out.dtype))[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_table_gradient_match_the_gather(monkeypatch, dtype):
  V, D = 37, 24
  ks = jax.random.split(jax.random.key(0), 3)
  table = jax.random.normal(ks[0], (V, D))
  tokens = _tokens(ks[1], (3, 50), V)
  ct = jax.random.normal(ks[2], (3, 50, D))
  o1, g1 = _grad(table, tokens, dtype, ct, True, monkeypatch)
  o0, g0 = _grad(table, tokens, dtype, ct, False, monkeypatch)
  assert o1.dtype == o0.dtype == dtype and g1.dtype == g0.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o0, np.float32))
  # Both sum in float32 whatever the compute dtype (a bfloat16 sum of the ~75 cotangents of token 3 would be
  # off by about 0.1): compare both to float64.
  ref = np.zeros((V, D))
  np.add.at(ref, np.asarray(tokens).ravel(), np.asarray(ct.astype(dtype), np.float64).reshape(-1, D))
  np.testing.assert_allclose(np.asarray(g1), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g0), ref, rtol=1e-5, atol=1e-5)


def test_out_of_range_tokens_read_nan_and_add_nothing(monkeypatch):
  table = jnp.arange(12.0).reshape(4, 3)
  tokens = jnp.array([[0, 4, 1, -7]])
  ct = jnp.ones((1, 4, 3))
  o1, g1 = _grad(table, tokens, jnp.float32, ct, True, monkeypatch)
  o0, g0 = _grad(table, tokens, jnp.float32, ct, False, monkeypatch)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o0))
  assert np.isnan(np.asarray(o1)[0, [1, 3]]).all() and np.isfinite(np.asarray(o1)[0, [0, 2]]).all()
  np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
  np.testing.assert_array_equal(np.asarray(g1)[:, 0], [1.0, 1.0, 0.0, 0.0])


def test_model_gradients_match_and_vmap(monkeypatch):
  # The token scan: the embedding's gradient is the subject, and it compiles in a fraction of the chunk form's time.
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, pattern="R",
                    recurrent=recurrent_preset("gated_deltanet", num_heads=2, head_dim=16, method="recurrent"))
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = _tokens(jax.random.key(1), (2, 24), cfg.vocab_size)

  def loss(p, t):
    logits = nnx.merge(graphdef, p, rest)(t)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., :-1, :].max(-1))

  grads = {}
  for on in (True, False):
    monkeypatch.setattr(embed, "ONEHOT_GRAD", on)
    grad = jax.jit(jax.grad(loss))  # traced anew per setting: a new function object each time
    grads[on] = grad(params, tokens)
    # Two rows through vmap (as gdn/train/stacked.py runs cells): each row's gradient is its own.
    stacked = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, tokens[:, None])
    np.testing.assert_allclose(np.asarray(stacked["embed"]["embedding"][...][0]),
                               np.asarray(grad(params, tokens[:1])["embed"]["embedding"][...]),
                               rtol=1e-5, atol=1e-6)
  flat1, flat0 = jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])
  assert len(flat1) == len(flat0)
  for a, b in zip(flat1, flat0):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # The switch is in the program: its VJP holds a dot where the gather's holds a scatter-add.
  for on, want in ((True, "dot_general"), (False, "scatter-add")):
    monkeypatch.setattr(embed, "ONEHOT_GRAD", on)
    text = str(jax.make_jaxpr(jax.grad(lambda t: embed.embed_lookup(t, tokens).sum()))(jnp.ones((64, 8))))
    assert want in text


def test_defaults_and_bad_switch(monkeypatch):
  assert embed.ONEHOT_GRAD is False and not embed.uses_onehot_grad()
  monkeypatch.setattr(embed, "ONEHOT_GRAD", None)
  with pytest.raises(ValueError, match="ONEHOT_GRAD must be True or False"):
    embed.uses_onehot_grad()
  with pytest.raises(ValueError, match="tokens must be integers"):
    embed.embed_lookup(jnp.ones((4, 2)), jnp.ones((3,)))
