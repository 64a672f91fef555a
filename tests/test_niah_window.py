"""experiments/niah_window.py: the fraction of S-NIAH's evaluation examples whose needle a window reaches."""

import numpy as np
import pytest

from experiments import niah_window
from gdn.data import niah


def test_within_measures_from_the_needle_marker_to_the_query_marker():
  rows = np.zeros((3, 40), np.int64)
  for r, (needle, query) in enumerate([(0, 30), (10, 30), (25, 30)]):
    rows[r, needle], rows[r, query] = niah.NEEDLE, niah.QUERY
  assert niah_window.within(rows, 20).tolist() == [False, False, True]
  assert niah_window.within(rows, 21).tolist() == [False, True, True]


def test_fractions_on_the_small_config(capsys):
  """A window as long as the longest split reaches every needle; a window of half the training length about
  half of them there, fewer at longer lengths; the printed table holds the returned rows."""
  everything = niah_window.main(["--config", "configs/niah.py:small", "--window", "512"])
  assert [r["split"] for r in everything][:4] == ["sniah1_T64", "sniah1_T128", "sniah1_T256", "sniah1_T512"]
  assert all(r["within"] == 1.0 and r["examples"] == 32 for r in everything)
  half = niah_window.main(["--config", "configs/niah.py:small", "--window", "32", "--seed", "1"])
  by_length = {}
  for r in half:
    by_length.setdefault(int(r["split"].rsplit("T", 1)[1]), []).append(r["within"])
  assert 0.2 < np.mean(by_length[64]) < 0.8
  assert np.mean(by_length[512]) < np.mean(by_length[64])
  out = capsys.readouterr().out
  assert "| sniah3_T512 | 32 |" in out


def test_overrides_reach_the_splits():
  """--config.key=value overrides, as gdn-compare takes them, set the splits counted: the examples of a run
  trained with those overrides."""
  rows = niah_window.main(["--config", "configs/niah.py:small", "--config.data.niah.eval_lengths=(256,)",
                           "--window", "512"])
  assert [r["split"] for r in rows] == ["sniah1_T256", "sniah2_T256", "sniah3_T256"]


def test_bad_arguments_are_refused():
  with pytest.raises(SystemExit):
    niah_window.main(["--config", "configs/niah.py:small", "--window", "0"])
  with pytest.raises(SystemExit):
    niah_window.main(["--config", "configs/mqar.py:small", "--window", "8"])
  with pytest.raises(SystemExit):
    niah_window.main(["--window", "8"])
