"""gdn.ops.pallas_matvec: the few-rows matmul kernel (Pallas' interpreter here) against a float64 product, the
shapes it takes, and a lean model's decode step through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import ModelConfig, RecurrentConfig
from gdn.model import LanguageModel, for_decoding
from gdn.ops import pallas_matvec as pm


@pytest.mark.parametrize("M, K, N, dtype", [(1, 256, 128, "bfloat16"), (3, 512, 64, "bfloat16"),
                                            (8, 128, 256, "float16"), (16, 96, 48, "bfloat16")])
def test_matvec_equals_the_float64_product(M, K, N, dtype):
  """Every plan: K split in slices (the first two: N / BN programs under MIN_PROGRAMS), one slice, blocks
  narrower than the defaults (96 and 48: blocks of 32 and 16); the result in x's dtype, to its rounding."""
  x = jax.random.normal(jax.random.key(0), (M, K)).astype(dtype)
  w = jax.random.normal(jax.random.key(1), (K, N)).astype(dtype)
  y = pm.matvec(x, w, interpret=True)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert y.shape == (M, N) and y.dtype == jnp.dtype(dtype)
  assert np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max() <= 8e-3
  assert pm.matvec(x, w, interpret=True, out_dtype=jnp.float32).dtype == jnp.float32


def test_plan_takes_what_the_kernel_can_and_refuses_the_rest():
  # The decode model's matmuls (d_model 2048): the output and down projections split K four ways (32 blocks of
  # outputs, 128 programs), the fused input projection (8224 = 32 x 257) takes blocks of 32, no split.
  assert pm.plan(1, 2048, 2048, jnp.bfloat16) == (64, 128, 4)
  assert pm.plan(1, 5632, 2048, jnp.bfloat16) == (64, 128, 4)
  assert pm.plan(8, 2048, 8224, jnp.bfloat16) == (32, 128, 1)
  for args in [(17, 64, 64, jnp.bfloat16), (1, 64, 64, jnp.float32), (1, 64, 40, jnp.bfloat16),
               (1, 24, 64, jnp.bfloat16)]:
    assert pm.plan(*args) is None, args
  x, w = jnp.ones((1, 24), jnp.bfloat16), jnp.ones((24, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="check `plan` first"):
    pm.matvec(x, w, interpret=True)
  with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
    pm.matvec(jnp.ones((2, 3, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="share a dtype"):
    pm.matvec(jnp.ones((1, 64), jnp.float16), jnp.ones((64, 64), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_lean_decode_step_through_the_kernel(monkeypatch, batch):
  """With MATVEC_KERNEL on, a bfloat16 lean model's matmuls that the kernel takes (here the output, MLP and
  attention projections; the recurrent layer's fused input projection, 260 wide, stays XLA's) run through it:
  the step's logits are those of XLA's matmuls to bfloat16 rounding."""
  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=4, pattern="RRRA", dtype="bfloat16",
                    recurrent=RecurrentConfig(num_heads=2, head_dim=32, chunk_size=16))
  lean = for_decoding(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(lean)
  cache = lean.init_cache(batch, 8)
  tokens = jax.random.randint(jax.random.key(1), (batch, 1), 0, 64, jnp.int32)

  def run(on):
    monkeypatch.setattr(pm, "MATVEC_KERNEL", on)
    step = lambda s, t, c: nnx.merge(graphdef, s).decode_step(t, c)[0]  # a new function: traced anew
    return jax.make_jaxpr(step)(state, tokens, cache), jax.jit(step)(state, tokens, cache)

  (jaxpr_off, off), (jaxpr_on, on) = run(False), run(True)
  assert str(jaxpr_on).count("pallas_call[") >= 5 and "pallas_call[" not in str(jaxpr_off)  # 4 MLPs, 4 o_proj
  off, on = np.asarray(off, np.float32), np.asarray(on, np.float32)
  assert np.abs(on - off).max() / np.abs(off).max() <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, N", [(1, 2048, 2048), (1, 2048, 8224), (8, 5632, 2048), (1, 2048, 11264)])
def test_compiled_on_gpu(M, K, N):
  """The compiled kernel at the decode model's shapes (d_model 2048: output, fused input, down and gate/up
  projections) against a float64 product, and equal to XLA's bfloat16 dot to its rounding."""
  x = jax.random.normal(jax.random.key(0), (M, K)).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (K, N)) * K**-0.5).astype(jnp.bfloat16)
  y = jax.jit(lambda x, w: pm.matvec(x, w, interpret=False))(x, w)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max() <= 8e-3
  xla = np.asarray(jnp.dot(x, w), np.float64)
  assert np.abs(np.asarray(y, np.float64) - xla).max() / np.abs(ref).max() <= 8e-3
