"""The fused decode-step kernel (`gdn.ops.pallas_decode`) against the mixer's XLA decode step, and a whole lean
model's decoding with it on against off.

Shapes: B batch, H q/k heads, HV value heads, K key dim, V value dim, D d_model.

On CPU the kernel runs in Pallas' interpreter, so the shapes are small; the `gpu` test runs it compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import ModelConfig, recurrent_preset
from gdn.layers.recurrent import RecurrentMixer
from gdn.model import LanguageModel, for_decoding
from gdn.ops import pallas_decode
from lowering import cuda_hlo

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 matmuls at float32 precision: on a GPU (where the non-`gpu` tests run compiled too) XLA's default is
  TF32, which would round the two paths' slightly different inputs of the next matmul apart."""
  with jax.default_matmul_precision("highest"):
    yield


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def _mixer(seed, dtype, D=32, **overrides):
  """A fused Gated DeltaNet mixer, and a random input token [B, 1, D] and cache (conv window and state)."""
  cfg = recurrent_preset("gated_deltanet", **{**dict(num_heads=2, head_dim=16), **overrides})
  m = RecurrentMixer(cfg, D, dtype=dtype, rngs=nnx.Rngs(seed))
  m.fuse()
  keys = jax.random.split(jax.random.key(seed + 1), 3)
  B = 2
  cache = m.init_cache(B)
  conv = None if cache.conv is None else jax.random.normal(keys[0], cache.conv.shape, cache.conv.dtype)
  cache = cache._replace(conv=conv, S=0.3 * jax.random.normal(keys[1], cache.S.shape, jnp.float32))
  return m, jax.random.normal(keys[2], (B, 1, D), dtype), cache


def _both(m, x, cache):
  """(o, conv window, S) from the mixer's XLA step and from the kernel, for one token."""
  B = x.shape[0]
  layout = m._decode_layout(cache, 1, None)
  assert layout is not None
  # Each path one program, as decoding runs it (not a hundred eager dispatches).
  want = nnx.jit(lambda m, x, cache: m._mix(m.in_proj(x), B=B, T=1, segment_ids=None, cache=cache,
                                            context_axis=None))(m, x, cache)
  got = nnx.jit(lambda m, x, cache: m._decode_fused(m.in_proj.matmul(x[:, 0]), cache, layout))(m, x, cache)
  return got, want


# GVA with negative eigenvalues; one value head per q/k head with K != V; V = 32 in value blocks of 8 (four steps
# of the kernel's loop over V) with biases on the projections and the conv, conv size 3.
CASES = {
    "gva_neg_eigval": dict(num_v_heads=4, allow_neg_eigval=True),
    "k_ne_v": dict(head_dim=8, v_head_dim=32, conv_size=2),
    "blocked_v_biases": dict(num_v_heads=4, v_head_dim=32, qkv_bias=True, conv_bias=True, conv_size=3),
    "wide_keys": dict(head_dim=256, v_head_dim=64),  # K > 128: value steps of BLOCK_V_WIDE
}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_the_xla_step(monkeypatch, case, dtype, tol, split):
  """The kernel per value head (a loop over blocks of 8 value channels) and over value blocks (`SPLIT_V`, blocks
  of 8, the norm after it in XLA) against the mixer's XLA step."""
  monkeypatch.setattr(pallas_decode, "DECODE_KERNEL", True)
  monkeypatch.setattr(pallas_decode, "BLOCK_V", 8)
  monkeypatch.setattr(pallas_decode, "SPLIT_V", split)
  monkeypatch.setattr(pallas_decode, "SPLIT_BLOCK_V", 8)
  m, x, cache = _mixer(0, jnp.dtype(dtype), **CASES[case])
  if m.cfg.qkv_bias:  # nonzero biases, so that a misplaced one shows
    m.in_proj.bias.set_value(0.1 * jax.random.normal(jax.random.key(9), m.in_proj.bias.shape, m.in_proj.bias.dtype))
    m.conv.bias.set_value(0.1 * jax.random.normal(jax.random.key(8), m.conv.bias.shape, m.conv.bias.dtype))
  got, want = _both(m, x, cache)
  for name, a, b in zip(("o", "conv", "S"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert rel_err(a, b) <= tol, (name, rel_err(a, b))
  assert rel_err(got[1], want[1]) == 0  # the window only moves inputs


def test_routing():
  """The kernel only where the switch asks for it (off by default on CPU) and the layer is a fused Gated DeltaNet
  decode step of shapes it takes; other variants keep the XLA path, raising nothing."""
  m, x, cache = _mixer(0, jnp.float32)
  assert pallas_decode.DECODE_KERNEL is None and not pallas_decode.enabled(64)  # the default: never in the interpreter
  try:
    pallas_decode.DECODE_KERNEL = False
    assert m._decode_layout(cache, 1, None) is None
    pallas_decode.DECODE_KERNEL = True
    assert m._decode_layout(cache, 1, None) is not None
    assert m._decode_layout(cache, 2, None) is None  # prefill
    assert m._decode_layout(None, 1, None) is None  # no cache
    for overrides in (dict(short_conv=False), dict(output_gate="sigmoid"), dict(head_dim=12), dict(beta="channel"),
                      dict(gate_lower_bound=-5.0)):  # the kernel computes the softplus gate
      other, _, c = _mixer(1, jnp.float32, **overrides)
      assert other._decode_layout(c, 1, None) is None, overrides
    cfg = recurrent_preset("kda", num_heads=2, head_dim=16, decay_low_rank=4)
    kda = RecurrentMixer(cfg, 32, rngs=nnx.Rngs(0))
    kda.fuse()
    assert kda._decode_layout(kda.init_cache(2), 1, None) is None
    unfused = RecurrentMixer(m.cfg, 32, rngs=nnx.Rngs(0))
    assert unfused._decode_layout(cache, 1, None) is None
    # The XLA path still runs with the switch on.
    y, c = kda(x, cache=kda.init_cache(2))
    assert y.shape == x.shape and c.S.shape == (2, 2, 16, 16)
  finally:
    pallas_decode.DECODE_KERNEL = False


def _count_calls(monkeypatch) -> list:
  """A list that gets one entry each time `fused_step` is traced."""
  calls, fused_step = [], pallas_decode.fused_step
  monkeypatch.setattr(pallas_decode, "fused_step", lambda *a, **k: calls.append(1) or fused_step(*a, **k))
  return calls


def _decode_logits(model, tokens, on: bool, prompt: int = 5):
  """Logits [B, T, Vocab] of a prefill of `prompt` tokens and one decode step per remaining token, traced with
  the switch `on` (jits of their own: the switch is read at trace time)."""
  before = pallas_decode.DECODE_KERNEL
  pallas_decode.DECODE_KERNEL = on
  try:
    prefill = nnx.jit(lambda m, t, c: m.prefill(t, c))
    decode = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    logits, cache = prefill(model, tokens[:, :prompt], cache)
    got = [logits]
    for t in range(prompt, tokens.shape[1]):
      logits, cache = decode(model, tokens[:, t:t + 1], cache)
      got.append(logits)
    return jnp.concatenate(got, 1)
  finally:
    pallas_decode.DECODE_KERNEL = before


@pytest.mark.parametrize("dtype, scan, tol", [("float32", False, 1e-5), ("bfloat16", True, 2e-2)])
def test_lean_model_decodes_the_same_with_the_kernel(monkeypatch, dtype, scan, tol):
  """A 2-layer lean model (GVA, negative eigenvalues), unrolled and scanned: its decode logits with the kernel
  equal those without, through a prefill and 3 decode steps."""
  calls = _count_calls(monkeypatch)
  rcfg = recurrent_preset("gated_deltanet", num_heads=2, num_v_heads=4, head_dim=8, allow_neg_eigval=True,
                          chunk_size=8)
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, pattern="R", recurrent=rcfg, dtype=dtype,
                    scan_layers=scan)
  lean = for_decoding(LanguageModel(cfg, rngs=nnx.Rngs(4)))
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 64, jnp.int32)
  want = _decode_logits(lean, tokens, False)
  assert not calls
  got = _decode_logits(lean, tokens, True)
  assert len(calls) == (1 if scan else 2)  # traced once per layer body
  assert rel_err(got, want) <= tol, rel_err(got, want)


def test_greedy_generation_is_the_same_with_the_kernel(monkeypatch):
  from gdn.generate import generate

  rcfg = recurrent_preset("gated_deltanet", num_heads=2, head_dim=8, chunk_size=8)
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, pattern="R", recurrent=rcfg)
  lean = for_decoding(LanguageModel(cfg, rngs=nnx.Rngs(6)))
  prompt = jax.random.randint(jax.random.key(7), (2, 5), 0, 64, jnp.int32)
  monkeypatch.setattr(pallas_decode, "DECODE_KERNEL", False)
  want = generate(lean, prompt, 4, rng=None, temperature=0.0)
  calls = _count_calls(monkeypatch)
  monkeypatch.setattr(pallas_decode, "DECODE_KERNEL", True)
  jax.clear_caches()  # `generate`'s jit traced the loop with the switch off
  np.testing.assert_array_equal(generate(lean, prompt, 4, rng=None, temperature=0.0), want)
  assert calls


def _gdn_args(B, H, HV, K, V, W, dtype, seed=0):
  """Random inputs of `fused_step` for a layer of these shapes, and its layout (allow_neg_eigval)."""
  C = 2 * H * K + HV * V
  lay = pallas_decode.Layout(H=H, HV=HV, K=K, V=V, a=C, b=C + HV, gate=C + 2 * HV, eps=1e-6, allow_neg_eigval=True)
  ks = jax.random.split(jax.random.key(seed), 6)
  N = C + 2 * HV + HV * V
  args = (jax.random.normal(ks[0], (B, N), dtype), jax.random.normal(ks[1], (B, W - 1, C), dtype),
          (0.3 * jax.random.normal(ks[2], (W, C))).astype(dtype), None,
          jnp.log(jax.random.uniform(ks[3], (HV,), jnp.float32, 1.0, 16.0)), jnp.full((HV,), -3.0, jnp.float32),
          0.3 * jax.random.normal(ks[4], (B, HV, K, V), jnp.float32), 1 + 0.1 * jax.random.normal(ks[5], (V,)))
  return args, lay


@pytest.mark.parametrize("split", [False, True])
def test_kernel_lowers_to_triton(split):
  """The compiled path lowers for CUDA (Triton IR from the kernel body: no primitive the Triton lowering lacks),
  with the state aliased in place; per value head and over value blocks."""
  args, lay = _gdn_args(1, 16, 16, 128, 128, 4, jnp.bfloat16)
  f = jax.jit(lambda *a: pallas_decode.fused_step(*a, layout=lay, interpret=False, split=split))
  hlo = cuda_hlo(f, *args)
  assert hlo.count("__gpu$xla.gpu.triton") == 1
  assert "output_tuple_indices = [1], operand_index = 5" in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("num_v_heads", [16, 32])
def test_compiled_on_gpu(monkeypatch, dtype, tol, num_v_heads, split):
  """The compiled kernel in a fused mixer at D = 2048, 16 heads x 128 (and GVA to 32 value heads), B = 8,
  against the mixer's XLA step; per value head and over value blocks."""
  monkeypatch.setattr(pallas_decode, "DECODE_KERNEL", True)
  monkeypatch.setattr(pallas_decode, "SPLIT_V", split)
  m, x, cache = _mixer(0, jnp.dtype(dtype), D=2048, num_heads=16, head_dim=128, num_v_heads=num_v_heads,
                       allow_neg_eigval=True)
  x = jnp.tile(x, (4, 1, 1))
  cache = jax.tree.map(lambda a: jnp.tile(a, (4,) + (1,) * (a.ndim - 1)), cache)
  got, want = _both(m, x, cache)
  for name, a, b in zip(("o", "conv", "S"), got, want):
    assert rel_err(a, b) <= tol, (name, rel_err(a, b))
