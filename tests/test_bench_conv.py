"""experiments/bench_conv.py: a row per switch setting and shape, the switch put back after."""

import numpy as np

from experiments import bench_conv
from gdn.layers import conv


def test_rows_per_setting_and_switch_restored(capsys):
  before = conv.CONV_LAX
  rows = bench_conv.main(["--shapes", "2,32,16", "--reps", "1", "--dtype", "float32"])
  assert [r["setting"] for r in rows] == ["layers.conv.CONV_LAX=off", "layers.conv.CONV_LAX=on"]
  assert all(np.isfinite(r["fwd"]) and np.isfinite(r["fwd_bwd"]) for r in rows)
  assert conv.CONV_LAX is before
  out = capsys.readouterr().out
  assert "| 2, 32, 16 | CONV_LAX=on |" in out


def test_floor_counts_two_and_five_arrays():
  f, fb = bench_conv.floors_ms((1, 1000, 1000), 2)
  assert np.isclose(fb / f, 2.5)
