"""Prefill + decode equals one full forward pass, for every mixer kind, with the prompt prefilled in pieces.

Shapes: B batch, T time, Vocab vocabulary size.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig, recurrent_preset
from gdn.model import LanguageModel

VOCAB = 64
# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")
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
    # fla's bounded KDA gate: the chunked op told the bound (matmul pair products), the decode step not
    "kda_bounded_gate": ("R", recurrent_preset("kda", decay_low_rank=4, gate_lower_bound=-5.0, **SMALL)),
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


def test_a_prompt_longer_than_the_cache_sees_a_window_of_max_len_however_it_is_cut():
  """18 tokens through a cache of 8: global attention becomes a window of 8, the same in one prefill, in pieces
  and in decode steps (a prefill piece's queries once saw the whole ring plus every new key)."""
  att = AttentionConfig(num_heads=2, head_dim=8)
  build = lambda pattern, window: LanguageModel(ModelConfig(
      vocab_size=VOCAB, d_model=32, num_layers=1, pattern=pattern,
      attention=dataclasses.replace(att, window=window)), rngs=nnx.Rngs(0))
  model, windowed = build("A", 0), build("W", 8)
  tokens = _tokens(B=1, T=18)
  want = _full(windowed, tokens)
  for pieces in ((18,), (6, 6, 6), (6,) + (1,) * 12):
    cache, got, t = model.init_cache(1, 8), [], 0
    for n in pieces:
      logits, cache = (_prefill if n > 1 else _decode)(model, tokens[:, t:t + n], cache)
      got.append(logits)
      t += n
    assert float(jnp.abs(jnp.concatenate(got, 1) - want).max() / jnp.abs(want).max()) <= 1e-5, pieces


def _prefill_then_decode(model, tokens):
  """Logits [B, T, Vocab] of a 19-token prefill and then one decode step per remaining token."""
  cache = model.init_cache(tokens.shape[0], tokens.shape[1])
  logits, cache = _prefill(model, tokens[:, :19], cache)
  got = [logits]
  for t in range(19, tokens.shape[1]):
    logits, cache = _decode(model, tokens[:, t:t + 1], cache)
    got.append(logits)
  return jnp.concatenate(got, 1)


LEAN = {
    "RRRA": ("RRRA", RecurrentConfig(**SMALL), False),
    "RRRA_scanned": ("RRRA", RecurrentConfig(**SMALL), True),
    # Per-channel decay and the low-rank gate (f_a / g_a fused, f_b / g_b after), grouped value heads.
    "kda_scanned": ("R", recurrent_preset("kda", num_v_heads=4, v_head_dim=12, decay_low_rank=4, **SMALL), True),
    # Biases on q, k, v and o, per-value-channel beta, no short conv.
    "seed": ("RW", recurrent_preset("seed", **SMALL), False),
}


# Each model kind in one compute dtype, the unrolled RRRA in both: the fused weights are cast to the compute dtype
# the same way for every kind.
@pytest.mark.parametrize("kind, dtype", [("RRRA", "float32"), ("RRRA", "bfloat16"), ("RRRA_scanned", "bfloat16"),
                                         ("kda_scanned", "float32"), ("seed", "bfloat16")])
def test_for_decoding_equals_the_model(kind, dtype):
  """`for_decoding` (fused projections, weights in the compute dtype) gives the model's logits through a prefill
  and decode steps, unrolled and scanned (6 layers: RRRA's one group and two remainder layers; R's six groups;
  scanned models also unrolled by unroll=True), and leaves the model as it was."""
  from gdn.model import for_decoding

  pattern, rcfg, scan = LEAN[kind]
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=6, pattern=pattern, recurrent=rcfg,
                    attention=ATTENTION, dtype=dtype, scan_layers=scan)
  model = LanguageModel(cfg, rngs=nnx.Rngs(2))
  params = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
  before = params(model)
  lean = for_decoding(model)
  tokens = _tokens()
  ref = _prefill_then_decode(model, tokens)
  tol = 1e-5 if dtype == "float32" else 1e-2
  assert float(jnp.abs(_prefill_then_decode(lean, tokens) - ref).max() / jnp.abs(ref).max()) <= tol
  if scan:  # unrolled for decoding: the same logits from the unstacked layers
    unrolled = for_decoding(model, unroll=True)
    assert not unrolled.cfg.scan_layers
    assert float(jnp.abs(_prefill_then_decode(unrolled, tokens) - ref).max() / jnp.abs(ref).max()) <= tol
  # The model is untouched; the lean copy holds its matmul weights in the compute dtype, its norms in float32.
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params(model),
                                         before)))
  flat = {jax.tree_util.keystr(path): x
          for path, x in jax.tree_util.tree_leaves_with_path(params(lean))}
  for name, x in flat.items():
    compute = name.endswith(("['kernel']", "['bias']", "['embedding']")) or "['conv']" in name
    assert x.dtype == (jnp.dtype(dtype) if compute else jnp.float32), name
  assert any("in_proj" in n for n in flat) and not any("q_proj" in n or "gate_proj" in n for n in flat)


def test_for_decoding_generates_the_same_tokens():
  from gdn.generate import generate
  from gdn.model import for_decoding

  model = _model("RRRA", seed=3)
  prompt = _tokens(T=7)
  want = generate(model, prompt, 6, rng=None, temperature=0.0)
  np.testing.assert_array_equal(generate(for_decoding(model), prompt, 6, rng=None, temperature=0.0), want)


@pytest.mark.parametrize("scan", [False, True])
def test_for_decoding_widens_the_mlp_with_zeros(scan):
  """mlp_multiple widens each SwiGLU's hidden layer (d_model 32: 88; None keeps it) with zero weights to a
  multiple (64 -> 128): the logits of a prefill and decode steps are the unwidened lean model's, unrolled and
  scanned; a bad multiple is refused."""
  from gdn.model import for_decoding

  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=6, pattern="RRRA", recurrent=RecurrentConfig(**SMALL),
                    attention=ATTENTION, scan_layers=scan)
  model = LanguageModel(cfg, rngs=nnx.Rngs(4))
  tokens = _tokens()
  ref = _prefill_then_decode(for_decoding(model, mlp_multiple=None), tokens)
  wide = for_decoding(model, mlp_multiple=64)
  kernels = {jax.tree_util.keystr(p): x.shape for p, x in
             jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(wide, nnx.Param)))
             if "'mlp'" in jax.tree_util.keystr(p)}
  assert kernels and all((s[-1] == 2 * 128) if "in_proj" in n else (s[-2] == 128) for n, s in kernels.items()), kernels
  got = _prefill_then_decode(wide, tokens)
  assert float(jnp.abs(got - ref).max() / jnp.abs(ref).max()) <= 1e-6
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match="mlp_multiple"):
      for_decoding(model, mlp_multiple=bad)


@pytest.mark.parametrize("scan", [False, True])
def test_lean_matmuls_of_one_row_run_on_two(monkeypatch, scan):
  """At batch 1 the lean model's matmuls whose weight is under XLA's strength-reduction size run on the row and a
  zero row (`gdn.layers.fused.PAD_SINGLE_ROW`; by default "auto": on a GPU only): the decode step's logits
  are those without, its compiled dots take two rows, and at batch 2 nothing is padded."""
  from gdn.layers import fused
  from gdn.model import for_decoding

  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=4, pattern="RRRA", recurrent=RecurrentConfig(**SMALL),
                    attention=ATTENTION, scan_layers=scan)
  lean = for_decoding(LanguageModel(cfg, rngs=nnx.Rngs(5)))
  layer = lean.scanned_blocks[0] if scan else lean.blocks[0]
  assert isinstance(layer.mixer.o_proj, fused.LeanLinear) and isinstance(layer.mlp.down_proj, fused.LeanLinear)

  def step(B, pad):
    """The logits of one decode step and the shapes of the compiled step's dots (a one-row dot may have lost its
    unit dimension)."""
    monkeypatch.setattr(fused, "PAD_SINGLE_ROW", pad)
    graphdef, state = nnx.split(lean)
    fn = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode_step(t, c)[0])
    args = (state, _tokens(B=B, T=1), lean.init_cache(B, 8))
    compiled = fn.lower(*args).compile()
    hlo = compiled.as_text()
    shapes = {tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"= \w+\[([\d,]*)\]\S* dot\(", hlo)}
    assert shapes, hlo
    return compiled(*args), shapes

  (off, dots_off), (on, dots_on) = step(1, False), step(1, True)
  np.testing.assert_allclose(np.asarray(on), np.asarray(off), rtol=1e-6, atol=1e-6)
  two_rows = lambda dots: {d for d in dots if len(d) == 2 and d[0] == 2}
  assert two_rows(dots_on) and not two_rows(dots_off), (dots_on, dots_off)
  assert step(2, True)[1] == step(2, False)[1]
  monkeypatch.setattr(fused, "PAD_SINGLE_ROW", True)
  assert fused.pads_single_row(1, (2048, 2048)) and not fused.pads_single_row(1, (2048, 8224))
  assert not fused.pads_single_row(2, (64, 64))
  monkeypatch.setattr(fused, "PAD_SINGLE_ROW", None)
  assert fused.pads_single_row(1, (64, 64)) == (jax.default_backend() == "gpu")
