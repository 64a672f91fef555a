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
