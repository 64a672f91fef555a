"""experiments/bench_layers.py runs at a tiny size: one table row per sequence length, positive timings."""

import os

import pytest

from experiments.bench_layers import main

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_bench_layers_table(capsys):
  # The token scan compiles in half the time of the chunk form on CPU; the table is the same either way.
  lengths, tokens = [16, 32], 64
  rows = main(["--d-model", "32", "--heads", "2", "--head-dim", "16", "--tokens", str(tokens), "--lengths",
               ",".join(map(str, lengths)), "--reps", "1", "--method", "recurrent"])
  out = capsys.readouterr().out
  assert out.startswith("# layer fwd+bwd, ") and "jax " in out.splitlines()[0], out

  lines = [line for line in out.splitlines() if line.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  table = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
  assert [int(r["T"]) for r in table] == lengths, out
  assert [int(r["B"]) for r in table] == [tokens // T for T in lengths]
  for r in table:
    for col in ("GDN fwd+bwd ms", "attention fwd+bwd ms", "GDN tokens/s", "attention tokens/s"):
      assert float(r[col].replace(",", "")) > 0, (col, r)
    assert float(r["attention/GDN"].rstrip("x")) > 0
    assert r["GDN method"] == "recurrent"
  assert "Crossover: " in out
  assert [r["T"] for r in rows] == lengths and all(r[k]["ms"] > 0 for r in rows for k in ("gdn", "attention"))


def test_bench_layer_fla_gdn_side_on_cpu(capsys, monkeypatch):
  """The gdn side of experiments/bench_layer_fla.py runs in its own process and fills its columns, a row per
  --local-groups value; the fla side (CUDA only) is left out here, and its cells say so rather than hold a number."""
  from experiments import bench_layer_fla

  # The cpu preset at half its width and one row of 128 tokens, its workers compiling with fewer optimisations:
  # the script's table is under test, not the layer's speed.
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  rows = bench_layer_fla.main(["--preset", "cpu", "--d-model", "32", "--tokens", "128", "--reps", "1", "--sides",
                               "gdn", "--method", "chunk", "--local-groups", "1,2"])
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if line.startswith("| 128 |")]
  assert len(lines) == 2, out
  for line, groups, r in zip(lines, ("1", "2"), rows):
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "none" and r["remat"] == "none", cells  # RecurrentConfig.remat's default
    assert cells[3] == groups and r["local_groups"] == int(groups), cells
    assert float(cells[4]) > 0 and cells[5] == "-" and cells[6] == "-", cells  # gdn ms; no fla ms, no ratio
    assert float(cells[9]) >= 0 and r["gdn_estimate"] > 0  # XLA's estimate (the CPU has no allocator peak)
    assert r["gdn_ms"] > 0 and "fla_ms" not in r


def test_bench_layer_fla_xla_flags_reach_gdns_process_one_row_each(capsys, monkeypatch, tmp_path):
  """--xla-flags: a gdn row per set given, each process compiling with those flags (here a dump directory, which
  then holds XLA's files) and the table naming them; the empty set adds nothing."""
  from experiments import bench_layer_fla

  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  dump = tmp_path / "dump"
  rows = bench_layer_fla.main(["--preset", "cpu", "--d-model", "32", "--tokens", "128", "--reps", "1", "--sides",
                               "gdn", "--method", "chunk", "--xla-flags=", f"--xla-flags=--xla_dump_to={dump}"])
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 |")]
  assert [r["xla_flags"] for r in rows] == ["", f"--xla_dump_to={dump}"] and all(r["gdn_ms"] > 0 for r in rows)
  assert [line.split("|")[5].strip() for line in lines] == ["-", f"--xla_dump_to={dump}"]
  assert any(name.endswith(".txt") for name in os.listdir(dump))
