"""experiments/op_memory.py: its tables, and --switch repeating them for every setting of a gdn.ops switch."""

import pytest

from experiments import op_memory
from gdn.ops import intra_chunk


def test_switch_repeats_the_tables_and_restores_the_setting(capsys):
  before = intra_chunk.LOCAL_VJP
  op_memory.main(["--shape", "1,128,1,16", "--groups", "1", "--methods", "chunk", "--no-layer", "--reps", "1",
                  "--switch", "intra_chunk.LOCAL_VJP"])
  out = capsys.readouterr().out.splitlines()
  titles = [l for l in out if l.startswith("# the op alone")]
  assert [t.endswith(s) for t, s in zip(titles, ("LOCAL_VJP off", "LOCAL_VJP on"))] == [True, True]
  rows = [l for l in out if l.startswith("| chunk |")]
  assert len(rows) == 4  # OUTPUT_VJP off and on, for each setting of the switch
  assert all(float(r.split("|")[4].replace(",", "")) > 0 for r in rows)
  assert intra_chunk.LOCAL_VJP == before
  with pytest.raises(SystemExit, match="no setting 'NOPE'"):
    op_memory.main(["--no-layer", "--switch", "intra_chunk.NOPE"])


def test_kda_decay_with_a_bound(capsys):
  """--decay channel --g-lower-bound: the KDA op's table, bounded, named in its title."""
  op_memory.main(["--shape", "1,64,1,16", "--groups", "1", "--methods", "chunk", "--no-layer", "--reps", "1",
                  "--decay", "channel", "--g-lower-bound", "-5"])
  out = capsys.readouterr().out.splitlines()
  assert any("channel decay, g_lower_bound -5" in l for l in out if l.startswith("# the op alone"))
  assert len([l for l in out if l.startswith("| chunk |")]) == 2
