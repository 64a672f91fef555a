"""generate: greedy is the forward pass's argmax, sampling filters, one trace for the whole decode loop.

Shapes: B batch, P prompt length, T time, Vocab vocabulary size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.generate import generate, sample
from gdn.model import LanguageModel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB = 64
SMALL = dict(num_heads=2, head_dim=8, chunk_size=16)
ATTENTION = AttentionConfig(num_heads=2, head_dim=8, window=5)


def _model(pattern, recurrent=None, seed=0, **kw):
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=len(pattern), pattern=pattern,
                    recurrent=recurrent or RecurrentConfig(**SMALL), attention=ATTENTION, **kw)
  return LanguageModel(cfg, rngs=nnx.Rngs(seed))


def _tokens(B=2, T=23, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


_full = nnx.jit(lambda m, t: m(t))


def test_generate_greedy_is_the_argmax_of_the_forward_pass():
  model = _model("RW")
  prompt = _tokens(T=7, seed=4)
  out = generate(model, prompt, 6, rng=None, temperature=0.0)
  assert out.shape == (2, 13) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :7], prompt)
  np.testing.assert_array_equal(generate(model, prompt, 6, rng=jax.random.key(5), temperature=0.0), out)
  teacher_forced = jnp.argmax(_full(model, out[:, :-1])[:, 6:], axis=-1)
  np.testing.assert_array_equal(teacher_forced, out[:, 7:])
  # top_k=1 and a tiny nucleus both leave only the argmax.
  np.testing.assert_array_equal(generate(model, prompt, 6, rng=jax.random.key(1), top_k=1), out)
  np.testing.assert_array_equal(generate(model, prompt, 6, rng=jax.random.key(1), top_p=1e-6), out)
  a = generate(model, prompt, 6, rng=jax.random.key(1), temperature=1.0)
  np.testing.assert_array_equal(generate(model, prompt, 6, rng=jax.random.key(1), temperature=1.0), a)


def test_generate_does_not_retrace_per_token(monkeypatch):
  calls = {"decode": 0, "prefill": 0}
  decode_step, prefill = LanguageModel.decode_step, LanguageModel.prefill

  def counting_decode(self, *a, **k):
    calls["decode"] += 1
    return decode_step(self, *a, **k)

  def counting_prefill(self, *a, **k):
    calls["prefill"] += 1
    return prefill(self, *a, **k)

  monkeypatch.setattr(LanguageModel, "decode_step", counting_decode)
  monkeypatch.setattr(LanguageModel, "prefill", counting_prefill)
  model = _model("RA", seed=7, tie_embeddings=False)  # a structure no other test compiled
  generate(model, _tokens(T=5, seed=1), 9, rng=jax.random.key(0), temperature=0.7, top_k=5)
  assert calls == {"decode": 1, "prefill": 1}  # one trace of the loop body for 9 tokens
  generate(model, _tokens(T=5, seed=2), 9, rng=jax.random.key(1), temperature=0.0, top_p=0.5)
  assert calls == {"decode": 1, "prefill": 1}  # new prompt values and sampling settings: no retrace


def test_sample_filters():
  logits = jnp.tile(jnp.log(jnp.asarray([[0.05, 0.5, 0.3, 0.1, 0.05]])), (512, 1))
  key = jax.random.key(0)
  jitted = jax.jit(lambda logits, key, t, k, p: sample(logits, key, temperature=t, top_k=k, top_p=p))
  draw = lambda temperature=1.0, top_k=0, top_p=1.0: np.asarray(jitted(logits, key, temperature, top_k, top_p))
  assert set(draw(top_k=2)) == {1, 2}
  assert set(draw(top_p=0.7)) == {1, 2}  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it
  assert set(draw(temperature=0.0)) == {1}
  assert set(draw()) == {0, 1, 2, 3, 4}
  # Ties at a cut-off: the filters count tokens, not values (ties go to the lower id).
  tied = lambda row, **kw: set(np.asarray(jitted(jnp.tile(jnp.asarray([row], jnp.float32), (512, 1)), key,
                                                  1.0, kw.get("top_k", 0), kw.get("top_p", 1.0))))
  assert tied([0.0, 1.0, 1.0, 1.0], top_k=2) == {1, 2}
  assert tied([0.0, 0.0, 0.0, 0.0], top_p=0.5) == {0, 1}


def test_generate_bad_input():
  model = _model("R")
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, _tokens(T=3), 0, rng=jax.random.key(0))
  with pytest.raises(ValueError, match="rng"):
    generate(model, _tokens(T=3), 2, rng=None, temperature=1.0)
  with pytest.raises(ValueError, match="prompt"):
    generate(model, jnp.zeros((3,), jnp.int32), 2, rng=jax.random.key(0))
  with pytest.raises(ValueError, match="top_p"):
    generate(model, _tokens(T=3), 2, rng=jax.random.key(0), top_p=0.0)
  with pytest.raises(ValueError, match="outside the model's vocabulary"):  # not NaN logits and token 0
    generate(model, jnp.asarray([[3, model.cfg.vocab_size, 7]]), 2, rng=None, temperature=0.0)
