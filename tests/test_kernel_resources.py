"""experiments/kernel_resources.py: the op's Triton kernels compiled offline for sm_90 (no GPU), with the Triton that
the interop extra installs (skipped without it)."""

import pytest

triton = pytest.importorskip("triton")


def test_kernel_table_at_a_small_shape(capsys):
  from experiments import kernel_resources

  rows = kernel_resources.main(["--length", "64", "--heads", "1", "--k", "64", "--v", "64",
                                "--switch", "ops.pallas_chunk.BWD_STATES=off,on"])
  names = [(r["setting"].split("=")[-1], r["call"], r["name"]) for r in rows]
  assert names == [("off", "forward", "gdn_chunk_local"), ("off", "forward", "gdn_chunk_output_fwd"),
                   ("off", "fwd+bwd", "gdn_chunk_states_fwd"), ("off", "fwd+bwd", "gdn_chunk_states_bwd"),
                   ("on", "forward", "gdn_chunk_local"), ("on", "forward", "gdn_chunk_output_fwd"),
                   ("on", "fwd+bwd", "gdn_chunk_states_fwd"), ("on", "fwd+bwd", "gdn_chunk_dstates_bwd")]
  for r in rows:  # at K = V = 64 in bfloat16 nothing comes near the limits
    assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and 0 < r["shared"] <= 227 * 1024, r
  assert "| BWD_STATES=on | fwd+bwd | gdn_chunk_dstates_bwd |" in capsys.readouterr().out


def test_decode_kernel_at_wide_keys_does_not_spill():
  """The decode kernel at the paper models' key width (K = 256; V = 256 keeps the compile short), bfloat16: its
  default value step does not spill, and a step of 64 does (20 bytes here, 228 at V = 512)."""
  from experiments import kernel_resources

  default, step64 = kernel_resources.main(["--decode", "--k", "256", "--v", "256", "--decode-block-v", "0,64"])
  assert default["name"] == "gdn_decode_step" and default["spill_stores"] == 0 and default["registers"] <= 255
  assert step64["spill_stores"] > 0


def test_conv_kernels_compile_for_sm90_without_spilling():
  """The short conv's three Triton kernels (gdn.layers.conv_kernel) at their first-choice [64, 64] blocks and 4
  warps: they lower (row windows of refs, the first and last blocks' branches) and none spills."""
  from experiments import kernel_resources

  rows = kernel_resources.main(["--batch", "2", "--length", "256", "--conv-channels", "256"])
  assert [(r["call"], r["name"]) for r in rows] == [
      ("forward", "gdn_short_conv"), ("fwd+bwd", "gdn_short_conv"), ("fwd+bwd", "gdn_short_conv_bwd_pre"),
      ("fwd+bwd", "gdn_short_conv_bwd_dx")]
  for r in rows:
    assert r["grid"] == (2, 4, 4) and r["warps"] == 4 and r["spill_stores"] == 0 and r["registers"] <= 255, r


def test_matvec_kernel_compiles_for_sm90_without_spilling():
  """gdn.ops.pallas_matvec at the decode model's shapes (d_model 2048, batch 1 and 8): it lowers for CUDA and
  compiles for sm_90 without spills, within the shared memory a block may use."""
  import jax
  import jax.numpy as jnp

  from gdn.bench.kernel_resources import resources, triton_kernels
  from gdn.ops import pallas_matvec

  for M, K, N in [(1, 2048, 2048), (1, 2048, 8224), (8, 5632, 2048)]:
    fn = jax.jit(lambda x, w: pallas_matvec.matvec(x, w, interpret=False))
    x, w = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
    (kernel,) = triton_kernels(fn, x, w)
    r = resources(kernel)
    assert kernel.name == "gdn_matvec" and r["spill_stores"] == 0 and 0 < r["shared"] <= 227 * 1024, (M, K, N, r)
