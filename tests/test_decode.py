"""Prefill + decode equals one full forward pass, for every mixer kind, with the prompt prefilled in pieces.

Shapes: B batch, T time, Vocab vocabulary size.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig, recurrent_preset
from gdn.model import LanguageModel

VOCAB = 64
SMALL = dict(num_heads=2, head_dim=8, chunk_size=16)
# GQA, Qwen3-Next's output gate, q/k norm and partial rotary, so that the cached path sees every option.
ATTENTION = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, output_gate="sigmoid",
                            rope_fraction=0.5, window=5)


def _model(pattern, recurrent=None, seed=0):
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=len(pattern), pattern=pattern,
                    recurrent=recurrent or RecurrentConfig(**SMALL), attention=ATTENTION)
  return LanguageModel(cfg, rngs=nnx.Rngs(seed))


def _tokens(B=2, T=23, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


_full = nnx.jit(lambda m, t: m(t))
_prefill = nnx.jit(lambda m, t, c: m.prefill(t, c))
_decode = nnx.jit(lambda m, t, c: m.decode_step(t, c))

KINDS = {
    **{name: ("R", recurrent_preset(name, **SMALL))
       for name in ("linear_attention", "gla_mamba2", "gated_deltanet", "seed")},
    # Grouped value heads, separate K / V dims and negative eigenvalues ride along on two of the presets.
    "deltanet": ("R", recurrent_preset("deltanet", allow_neg_eigval=True, **SMALL)),
    "kda": ("R", recurrent_preset("kda", num_v_heads=4, v_head_dim=12, decay_low_rank=4, **SMALL)),
    "attention": ("A", None),
    "sliding_window": ("W", None),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prefill_in_pieces_then_decode_equals_full_forward(kind):
  """Prompt of 19 (not a multiple of the chunk size 16) prefilled as 5 + 14 tokens (the second piece runs the
  chunked op from a state; for the window-5 layer it overruns the ring), then 4 decode steps."""
  pattern, rcfg = KINDS[kind]
  model = _model(pattern, rcfg, seed=1)
  tokens = _tokens()
  full = _full(model, tokens)
  cache = model.init_cache(2, 23)
  got = []
  for lo, hi in ((0, 5), (5, 19)):
    logits, cache = _prefill(model, tokens[:, lo:hi], cache)
    got.append(logits)
  for t in range(19, 23):
    logits, cache = _decode(model, tokens[:, t:t + 1], cache)
    got.append(logits)
  got = jnp.concatenate(got, 1)
  assert float(jnp.abs(got - full).max() / jnp.abs(full).max()) <= 1e-4
