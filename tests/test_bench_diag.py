"""The diagonal-block kernels' benchmark runs on CPU (the kernels in Pallas' interpreter) and checks what it times."""

import pytest

from experiments import bench_diag
from gdn.ops import intra_chunk, pallas_diag

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_runs_every_variant_and_restores_the_settings(capsys):
  before = (intra_chunk.CHANNEL_DIAG_KERNEL, pallas_diag.RUNNING_SUMS, pallas_diag.NUM_WARPS)
  out = bench_diag.main(["--shapes", "1,64,1,16", "--warps", "2", "--reps", "1", "--dtype", "float32"])
  rows = out[(1, 64, 1, 16)]
  assert [r[0] for r in rows] == ["XLA levels", "kernel, scans, 2 warps", "kernel, running sums, 2 warps"]
  for name, fwd, both, err_a, err_p, err_g in rows:
    assert fwd > 0 and both > 0, name
    assert max(err_a, err_p, err_g) < 1e-5, name  # float32 inputs: the kernels agree with XLA's levels
  assert "| kernel, running sums, 2 warps |" in capsys.readouterr().out
  assert (intra_chunk.CHANNEL_DIAG_KERNEL, pallas_diag.RUNNING_SUMS, pallas_diag.NUM_WARPS) == before


def test_key_slices_and_two_loops_are_variants_and_bad_settings_are_refused(capsys):
  out = bench_diag.main(["--shapes", "1,32,1,32", "--running", "off,on", "--warps", "1", "--block-k", "all,16",
                         "--bwd-row-loop", "off,on", "--reps", "1", "--dtype", "float32"])
  rows = out[(1, 32, 1, 32)]
  # the two-loop backward runs with running sums only
  assert [r[0] for r in rows] == [
      "XLA levels", "kernel, scans, 1 warps", "kernel, scans, 1 warps, keys by 16", "kernel, running sums, 1 warps",
      "kernel, running sums, 1 warps, two-loop backward", "kernel, running sums, 1 warps, keys by 16",
      "kernel, running sums, 1 warps, keys by 16, two-loop backward"]
  assert max(max(r[3:]) for r in rows) < 1e-5
  assert (pallas_diag.BLOCK_K, pallas_diag.BWD_BLOCK_K, pallas_diag.BWD_ROW_LOOP) == (None, None, False)
  for flag, bad in (("--block-k", "24"), ("--block-k", "8"), ("--block-k", "x"), ("--bwd-row-loop", "yes"),
                    ("--warps", "3"), ("--warps", "four")):
    with pytest.raises(SystemExit):
      bench_diag.main([flag, bad])
  err = capsys.readouterr().err
  assert "--block-k takes" in err and "--bwd-row-loop takes" in err and "--warps takes" in err


def test_rejects_a_length_of_no_whole_sub_chunks():
  with pytest.raises(ValueError, match="multiple of 16"):
    bench_diag.sub_chunks((1, 40, 1, 16), "float32")


def test_resources_offline_for_sm90():
  """--resources compiles both kernels for sm_90 with the installed Triton (skipped without it): at 8 warps
  neither spills, with scans or running sums (the running sums' forward needs no shared memory at all)."""
  pytest.importorskip("triton")
  rows = bench_diag.main(["--resources", "--warps", "8"])
  assert [(r, w, b, n) for r, w, b, _, n, _ in rows] == [
      (False, 8, None, "gdn_channel_diag_blocks"), (False, 8, None, "gdn_channel_diag_blocks_bwd"),
      (True, 8, None, "gdn_channel_diag_blocks"), (True, 8, None, "gdn_channel_diag_blocks_bwd")]
  for running, _, _, _, name, res in rows:
    assert 0 < res["registers"] <= 255 and res["spill_stores"] == 0, (running, name, res)
  assert rows[2][5]["shared"] == 0
