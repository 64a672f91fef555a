"""LanguageModel: the logits interface, layer pattern, dtypes, initialisation, packed segments, prefill in pieces.

Shapes: B batch, T time, Vocab vocabulary size.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.layers import Attention, RecurrentMixer
from gdn.model import LanguageModel

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB = 64


def _cfg(**kw):
  base = dict(vocab_size=VOCAB, d_model=32, num_layers=4, pattern="RRRA",
              recurrent=RecurrentConfig(num_heads=2, head_dim=8, chunk_size=16),
              attention=AttentionConfig(num_heads=2, head_dim=8, window=5))
  return ModelConfig(**{**base, **kw})


def _tokens(B=2, T=21, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


@nnx.jit
def _logits_seg(model, tokens, segment_ids):
  return model(tokens, segment_ids=segment_ids)


def _rel(a, b):
  return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def test_interface_and_layer_pattern():
  model = LanguageModel(_cfg(pattern="RW", num_layers=3, tie_embeddings=False), rngs=nnx.Rngs(0))
  kinds = [type(b.mixer) for b in model.blocks]
  assert kinds == [RecurrentMixer, Attention, RecurrentMixer]
  assert model.blocks[1].mixer.window == 5 and model.lm_head is not None
  tokens = _tokens()
  logits = _logits(model, tokens)
  assert logits.shape == (2, 21, VOCAB) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  # Also under plain jax.jit of the split state, which training code may use.
  graphdef, state = nnx.split(model)
  plain = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
  np.testing.assert_allclose(plain, logits, rtol=1e-6, atol=1e-6)
  # Causal end to end: changing the tokens after t0 leaves every logit up to t0 unchanged.
  t0 = 12
  other = tokens.at[:, t0 + 1:].set((tokens[:, t0 + 1:] + 7) % VOCAB)
  np.testing.assert_array_equal(_logits(model, other)[:, :t0 + 1], logits[:, :t0 + 1])


def test_m_layers_use_their_own_recurrent_config():
  """The paper's H2 ("MRW"): "M" layers take ModelConfig.mamba2 (by default no delta rule, so no b_proj), "R"
  layers ModelConfig.recurrent; prefill then decode still equals one full forward pass."""
  cfg = _cfg(pattern="MRW", num_layers=3, mamba2=RecurrentConfig(num_heads=2, head_dim=16, beta="none"))
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  m, r = model.blocks[0].mixer, model.blocks[1].mixer
  assert m.cfg.beta == "none" and m.cfg.head_dim == 16 and m.b_proj is None
  assert r.cfg.beta == "head" and r.cfg.head_dim == 8 and r.b_proj is not None
  tokens = _tokens(T=19, seed=4)
  full = _logits(model, tokens)
  cache = model.init_cache(2, 24)
  head, cache = nnx.jit(lambda m, t, c: m.prefill(t, c))(model, tokens[:, :15], cache)
  tail, _ = nnx.jit(lambda m, t, c: m.decode_step(t, c))(model, tokens[:, 15:16], cache)
  assert _rel(jnp.concatenate([head, tail], 1), full[:, :16]) <= 1e-4


def test_tied_embeddings_have_no_head():
  model = LanguageModel(_cfg(pattern="R", num_layers=1), rngs=nnx.Rngs(0))
  assert model.lm_head is None
  params = nnx.state(model, nnx.Param)
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n < VOCAB * 32 * 2 + 40_000


def test_mlp_ratio_zero_drops_the_mlp():
  with_mlp = LanguageModel(_cfg(pattern="A", num_layers=2), rngs=nnx.Rngs(0))
  without = LanguageModel(_cfg(pattern="A", num_layers=2, mlp_ratio=0), rngs=nnx.Rngs(0))
  assert all(b.mlp is None and b.mlp_norm is None for b in without.blocks)
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  hidden = with_mlp.blocks[0].mlp.up_proj.kernel.shape[1]
  assert count(with_mlp) - count(without) == 2 * (3 * 32 * hidden + 32)
  tokens = _tokens()
  assert _logits(without, tokens).shape == (2, 21, VOCAB)
  # Without the MLP branch the blocks compute something else.
  assert not np.allclose(_logits(without, tokens), _logits(with_mlp, tokens))
  with pytest.raises(ValueError, match="mlp_ratio"):
    _cfg(mlp_ratio=-1)


def test_bfloat16_compute_keeps_float32_params():
  model = LanguageModel(_cfg(dtype="bfloat16", pattern="RA", num_layers=2), rngs=nnx.Rngs(0))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  ref = LanguageModel(_cfg(pattern="RA", num_layers=2), rngs=nnx.Rngs(0))
  tokens = _tokens()
  lo16, lo32 = _logits(model, tokens), _logits(ref, tokens)
  assert lo16.dtype == jnp.float32
  assert _rel(lo16, lo32) < 0.05


def test_initialisation():
  cfg = _cfg(d_model=64, num_layers=2, pattern="RA", init_std=0.02)
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  std = lambda p: float(jnp.std(p[...]))
  assert std(model.embed.embedding) == pytest.approx(0.02, rel=0.05)
  out_std = 0.02 / math.sqrt(2 * 2)
  for block in model.blocks:
    assert std(block.mlp.down_proj.kernel) == pytest.approx(out_std, rel=0.1)
    assert std(block.mlp.up_proj.kernel) == pytest.approx(0.02, rel=0.1)
    assert std(block.mixer.o_proj.kernel) == pytest.approx(out_std, rel=0.1)
    np.testing.assert_array_equal(block.mixer_norm.weight[...], 1.0)


def test_packed_segments_equal_separate_sequences():
  """Recurrent states restart, short convs and attention stay inside each segment, also when an id is reused
  after a segment shorter than the conv kernel."""
  model = LanguageModel(_cfg(pattern="RA", num_layers=2), rngs=nnx.Rngs(1))
  a, b, c = _tokens(B=1, T=9, seed=1), _tokens(B=1, T=2, seed=2), _tokens(B=1, T=12, seed=3)
  packed = jnp.concatenate([a, b, c], 1)
  seg = jnp.asarray([[3] * 9 + [4] * 2 + [3] * 12], jnp.int32)
  got = _logits_seg(model, packed, seg)
  assert _rel(got[:, :9], _logits(model, a)) < 1e-5
  assert _rel(got[:, 11:], _logits(model, c)) < 1e-4


def test_prefill_in_pieces_then_decode_equals_full_forward():
  """3:1 hybrid: prompt prefilled as 5 + 14 + 3 tokens (recurrent scan, chunked op from a state, scan again),
  then decoded a token at a time; every logit matches one full forward pass."""
  model = LanguageModel(_cfg(pattern="RRRA"), rngs=nnx.Rngs(2))
  tokens = _tokens(T=26, seed=3)
  full = _logits(model, tokens)
  prefill = nnx.jit(lambda m, t, c: m.prefill(t, c))
  decode = nnx.jit(lambda m, t, c: m.decode_step(t, c))
  cache = model.init_cache(2, 32)
  got = []
  for lo, hi in ((0, 5), (5, 19), (19, 22)):
    logits, cache = prefill(model, tokens[:, lo:hi], cache)
    got.append(logits)
  for t in range(22, 26):
    logits, cache = decode(model, tokens[:, t:t + 1], cache)
    got.append(logits)
  assert _rel(jnp.concatenate(got, 1), full) <= 1e-4
  assert int(cache[3].pos) == 26


def test_bad_input_raises_clear_errors():
  model = LanguageModel(_cfg(pattern="RA", num_layers=2), rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="tokens"):
    model(jnp.zeros((1, 4), jnp.float32))
  with pytest.raises(ValueError, match="tokens"):
    model(jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids"):
    model(jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.zeros((1, 5), jnp.int32))
  V = model.cfg.vocab_size
  cache = model.init_cache(1, 8)
  # Ids outside the vocabulary would gather NaN embeddings and give NaN logits without a word: named instead.
  for call in (model, model.features, lambda t: model.prefill(t, cache), lambda t: model.decode_step(t[:, 1:2], cache)):
    for bad in (V, -1):
      with pytest.raises(ValueError, match=rf"outside the model's vocabulary \[0, {V}\)"):
        call(jnp.array([[1, bad, 2]], jnp.int32))
  assert bool(jnp.all(jnp.isfinite(model(jnp.array([[0, V - 1]], jnp.int32)))))
  with pytest.raises(ValueError, match="decode_step"):
    model.decode_step(jnp.zeros((1, 2), jnp.int32), cache)
  with pytest.raises(ValueError, match="cache"):
    model.prefill(jnp.zeros((1, 2), jnp.int32), cache[:1])
  with pytest.raises(TypeError, match="ModelConfig"):
    LanguageModel(RecurrentConfig(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pattern"):
    _cfg(pattern="RX")
  with pytest.raises(ValueError, match="tie_embeddings must be a bool"):
    _cfg(tie_embeddings="no")
  # Values that passed the comparisons and failed later inside a shape: named here.
  with pytest.raises(ValueError, match="window must be an int"):
    AttentionConfig(num_heads=2, head_dim=8, window=2.5)
  with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
    AttentionConfig(num_heads=2, head_dim=8, num_kv_heads=2.0)
  with pytest.raises(ValueError, match="num_v_heads must be a positive int"):
    RecurrentConfig(num_heads=2, head_dim=8, num_v_heads=4.0)
