"""The cache-memory calculator: the seed's section 6.6.6 table, and the bytes of a real model's live cache."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdn import memory
from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig, recurrent_preset
from gdn.layers.attention import KVCache
from gdn.layers.recurrent import RecurrentCache
from gdn.model import LanguageModel

SEED_CONTEXTS = (4096, 32768, 131072)


def test_seed_kv_cache_is_gib():
  # The seed's "1.50 / 12.00 / 48.00 GB" are exact GiB: B L n H d 2 2 bytes.
  cfg = memory.seed_config("A")
  for n, gib in zip(SEED_CONTEXTS, (1.5, 12.0, 48.0)):
    kv = memory.kv_cache_bytes(cfg, 1, n)
    assert kv == 1 * 48 * n * 16 * 128 * 2 * 2
    assert kv == gib * memory.GiB
    assert f"{kv / memory.GiB:.2f}" == f"{gib:.2f}"
    assert kv / memory.MB > 1.07 * gib * 1000  # in decimal GB it would read 1.61 / 12.88 / 51.54


def test_seed_state_is_decimal_mb():
  # The seed's "about 25.17 MB" is 10^6-byte MB (it is 24.00 MiB), independent of context length.
  cfg = memory.seed_config("R")
  state = memory.recurrent_state_bytes(cfg, 1, "bfloat16")
  assert state == 1 * 48 * 16 * 128 * 128 * 2 == 25_165_824
  assert f"{state / memory.MB:.2f}" == "25.17"
  assert state == 24 * memory.MiB
  for n in SEED_CONTEXTS:
    c = memory.cache_bytes(cfg, 1, n, state_dtype="bfloat16")
    assert (c.kv, c.state, c.conv, c.index) == (0, state, 0, 0)
  assert memory.conv_state_bytes(cfg, 1) == 0
  # The seed: at 128K tokens attention needs 48 GiB against ~25 MB, "nearly 2000x".
  assert memory.kv_cache_bytes(memory.seed_config("A"), 1, 131072) // state == 2048


def test_seed_hybrid_three_to_one():
  # "RRRA" x 12: 36 recurrent layers and 12 attention layers; KV is a quarter of the attention model's.
  hybrid = memory.seed_config("RRRA")
  for n, gib in zip(SEED_CONTEXTS, (0.375, 3.0, 12.0)):
    c = memory.cache_bytes(hybrid, 1, n, state_dtype="bfloat16")
    assert c.kv == gib * memory.GiB == memory.kv_cache_bytes(memory.seed_config("A"), 1, n) / 4
    assert c.state == 36 * 16 * 128 * 128 * 2 == 18_874_368
    assert c.index == 12 * (n + 1) * 4
    assert c.total == c.kv + c.state + c.index


def test_cli_prints_seed_table(capsys):
  assert memory.main([]) == 0
  out = capsys.readouterr().out
  rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line[:1] in ("A", "R")}
  for n, gib in zip(SEED_CONTEXTS, ("1.50", "12.00", "48.00")):
    assert rows[("A", str(n))][2] == gib
    assert rows[("R", str(n))][3:5] == ["25.17", "24.00"]
    assert rows[("RRRA", str(n))][3] == "18.87"
  assert "GiB = 2^30 bytes" in out and "MB = 10^6 bytes" in out


def test_cli_rejects_bad_arguments(capsys):
  for argv in (["--dtype", "nope"], ["--contexts", "0"], ["--batch", "0"], ["--patterns", "RX"]):
    with pytest.raises(SystemExit):
      memory.main(argv)
  assert "gdn-memory: error" in capsys.readouterr().err


def test_arguments_are_checked():
  with pytest.raises(TypeError, match="cfg"):
    memory.cache_bytes(RecurrentConfig(), 1, 8)
  with pytest.raises(ValueError, match="context"):
    memory.cache_bytes(ModelConfig(), 1, 0)
  with pytest.raises(ValueError, match="batch"):
    memory.cache_bytes(ModelConfig(), -1, 8)
  with pytest.raises(ValueError, match="dtype"):
    memory.cache_bytes(ModelConfig(), 1, 8, state_dtype="float99")


LIVE_CONFIGS = {
    "hybrid_f32": ModelConfig(vocab_size=32, d_model=32, num_layers=4, pattern="RRRA",
                              recurrent=RecurrentConfig(num_heads=2, head_dim=8),
                              attention=AttentionConfig(num_heads=2, head_dim=8)),
    "gva_gqa_bf16": ModelConfig(vocab_size=32, d_model=32, num_layers=5, pattern="RRA", dtype="bfloat16",
                                recurrent=RecurrentConfig(num_heads=2, num_v_heads=4, head_dim=8, v_head_dim=12,
                                                          conv_size=3),
                                attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)),
    "window_longer_than_context": ModelConfig(vocab_size=32, d_model=32, num_layers=2, pattern="RW",
                                              attention=AttentionConfig(num_heads=2, head_dim=8, window=64),
                                              recurrent=RecurrentConfig(num_heads=2, head_dim=8)),
    "window_shorter_than_context": ModelConfig(vocab_size=32, d_model=32, num_layers=3, pattern="WA",
                                               attention=AttentionConfig(num_heads=2, head_dim=8, window=5)),
    "seed_no_conv": ModelConfig(vocab_size=32, d_model=32, num_layers=2, pattern="R",
                                recurrent=recurrent_preset("seed", num_heads=4, head_dim=8)),
    "kda": ModelConfig(vocab_size=32, d_model=32, num_layers=2, pattern="RA",
                       recurrent=recurrent_preset("kda", num_heads=2, head_dim=8, decay_low_rank=4),
                       attention=AttentionConfig(num_heads=2, head_dim=8, output_gate="sigmoid", qk_norm=True)),
}


def _nbytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(LIVE_CONFIGS))
def test_live_cache_has_the_predicted_bytes(name):
  cfg = LIVE_CONFIGS[name]
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  batch, context = 3, 37
  cache = model.init_cache(batch, context)
  layers = memory.layer_cache_bytes(cfg, batch, context)
  assert len(cache) == len(layers) == cfg.num_layers
  for live, predicted in zip(cache, layers):
    if isinstance(live, RecurrentCache):
      assert live.S.nbytes == predicted.state
      assert _nbytes(live.conv) == predicted.conv
      assert predicted.kv == predicted.index == 0
    else:
      assert isinstance(live, KVCache)
      assert live.k.nbytes + live.v.nbytes == predicted.kv
      assert live.kpos.nbytes + live.pos.nbytes == predicted.index
      assert predicted.state == predicted.conv == 0
  assert _nbytes(cache) == memory.cache_bytes(cfg, batch, context).total


def test_live_cache_after_prefill_keeps_its_bytes():
  # Prefill and decoding write into the cache; they must not grow it (shapes only: no need to run the model).
  cfg = LIVE_CONFIGS["gva_gqa_bf16"]
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  cache = model.init_cache(2, 16)

  def prefill_then_decode(state, cache):
    m = nnx.merge(graphdef, state)
    _, cache = m.prefill(jnp.zeros((2, 5), jnp.int32), cache)
    return m.decode_step(jnp.zeros((2, 1), jnp.int32), cache)[1]

  out = jax.eval_shape(prefill_then_decode, state, cache)
  assert jax.tree.structure(out) == jax.tree.structure(cache)
  nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(out))
  assert nbytes == memory.cache_bytes(cfg, 2, 16).total


def test_cache_bytes_add_up():
  cfg = dataclasses.replace(LIVE_CONFIGS["hybrid_f32"], num_layers=8)
  total = memory.cache_bytes(cfg, 2, 100)
  assert total == sum(memory.layer_cache_bytes(cfg, 2, 100), memory.CacheBytes())
  assert total.total == total.kv + total.state + total.conv + total.index
