"""The benchmark scripts' --switch helpers (experiments/cli.py): settings, labels, setting and putting back."""

import pytest

from experiments.cli import apply_setting, setting_label, switch_settings
from gdn.ops import intra_chunk


def test_switch_settings_combine_repeated_switches():
  assert switch_settings(None) == ["-"] and switch_settings([]) == ["-"]
  assert switch_settings("ops.intra_chunk.LOWP_SOLVE=off,on") == ["ops.intra_chunk.LOWP_SOLVE=off",
                                                                   "ops.intra_chunk.LOWP_SOLVE=on"]
  both = switch_settings(["ops.intra_chunk.LOWP_SOLVE=off,on", "ops.intra_chunk.LOCAL_VJP=on"])
  assert both == ["ops.intra_chunk.LOWP_SOLVE=off+ops.intra_chunk.LOCAL_VJP=on",
                  "ops.intra_chunk.LOWP_SOLVE=on+ops.intra_chunk.LOCAL_VJP=on"]
  assert setting_label(both[1]) == "LOWP_SOLVE=on+LOCAL_VJP=on"


def test_apply_setting_sets_every_part_and_puts_them_back():
  before = (intra_chunk.LOWP_SOLVE, intra_chunk.LOCAL_VJP)
  restore = apply_setting("ops.intra_chunk.LOWP_SOLVE=on+ops.intra_chunk.LOCAL_VJP=on")
  assert (intra_chunk.LOWP_SOLVE, intra_chunk.LOCAL_VJP) == (True, True)
  restore()
  assert (intra_chunk.LOWP_SOLVE, intra_chunk.LOCAL_VJP) == before
  apply_setting("-")()  # nothing set, nothing to put back
  # A bad part names itself, and the parts set before it are put back.
  with pytest.raises(SystemExit, match="no setting 'NO_SUCH'"):
    apply_setting("ops.intra_chunk.LOWP_SOLVE=on+ops.intra_chunk.NO_SUCH=on")
  with pytest.raises(SystemExit, match="'maybe' is not one it takes"):
    apply_setting("ops.intra_chunk.LOCAL_VJP=maybe")
  # "primal" is SEGSUM_MATMUL's alone.
  with pytest.raises(SystemExit, match=r"'primal' is not one it takes \(off, on, auto\)"):
    apply_setting("ops.intra_chunk.LOCAL_VJP=primal")
  assert (intra_chunk.LOWP_SOLVE, intra_chunk.LOCAL_VJP) == before
  seg = intra_chunk.SEGSUM_MATMUL
  restore = apply_setting("ops.intra_chunk.SEGSUM_MATMUL=primal")
  assert intra_chunk.SEGSUM_MATMUL == "primal"
  restore()
  assert intra_chunk.SEGSUM_MATMUL is seg


def test_integer_settings_take_integers_and_switches_do_not():
  from gdn.layers import conv_kernel
  assert conv_kernel.supported(128, 256, 4) == (64, 64)
  restore = apply_setting("layers.conv_kernel.BLOCK_T=16+layers.conv_kernel.BLOCK_C=32")
  assert (conv_kernel.BLOCK_T, conv_kernel.BLOCK_C) == (16, 32)
  assert conv_kernel.supported(128, 256, 4) == (16, 32)
  assert conv_kernel.supported(128, 48, 4) is None  # a size that does not divide C: XLA's taps
  restore()
  assert (conv_kernel.BLOCK_T, conv_kernel.BLOCK_C) == (0, 0) and conv_kernel.supported(128, 256, 4) == (64, 64)
  # A boolean switch takes no integer, and an integer setting no "on".
  with pytest.raises(SystemExit, match=r"'1' is not one it takes \(off, on, auto\)"):
    apply_setting("ops.intra_chunk.LOCAL_VJP=1")
  with pytest.raises(SystemExit, match=r"'on' is not one it takes \(an integer\)"):
    apply_setting("layers.conv_kernel.BLOCK_T=on")
