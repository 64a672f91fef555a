"""experiments/bench_ops.py and the helpers it shares (gdn.bench): the roofline floor and a tiny run of its table."""

import pytest

from experiments import bench_ops
from gdn.bench import op_inputs, roofline

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_roofline_of_the_largest_h200_shape():
  # (4, 4096, 64, 128): about 1.9e11 FLOP and 1.07 GB of q, k, v, o in bf16 forward, a floor of about 0.25 ms on
  # an H200 (790 TFLOP/s, 4.3 TB/s); the two bounds are nearly equal at this shape.
  r = roofline.roofline((4, 4096, 64, 128))
  assert r["fwd_flop"] == pytest.approx(1.918e11, rel=1e-3)
  assert r["fwd_bytes"] == 4 * 4 * 4096 * 64 * 128 * 2
  fwd, fb = roofline.floor_ms((4, 4096, 64, 128))
  assert fwd == pytest.approx(1.07374e9 / 4.3e12 * 1e3, rel=1e-4)  # memory-bound, just
  assert fb == pytest.approx(3 * 1.918e11 / 790e12 * 1e3, rel=1e-3)  # compute-bound: 3x the forward's FLOP
  # A short sequence of small heads is bound by its bytes; the FLOP grow with T, the bytes too: per token the
  # ratio is fixed, so doubling T doubles both floors.
  one, two = roofline.floor_ms((1, 1024, 2, 64)), roofline.floor_ms((1, 2048, 2, 64))
  assert two == pytest.approx(tuple(2 * x for x in one))


def test_table_runs_on_cpu(capsys):
  bench_ops.main(["--methods", "chunk", "associative", "--shapes", "1,128,2,16", "--reps", "1"])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 1, 128, 2, 16 |")]
  assert [l.split("|")[2].strip() for l in lines] == ["chunk", "associative"]
  for line in lines:
    fwd, fb = (float(x) for x in line.split("|")[3:5])
    assert 0 < fwd and 0 < fb


def test_breakdown_prefixes_compose_the_pallas_method(capsys):
  """The breakdown times `pallas` cut after each stage: its last prefix must be the op itself (here in Pallas'
  interpreter), and the table prints one row per stage."""
  import jax.numpy as jnp
  import numpy as np

  from gdn.ops import gated_delta_rule

  shape = (1, 100, 2, 16)
  args, _ = op_inputs.inputs(shape, jnp.float32)
  *_, full = bench_ops.pallas_prefixes()
  want, _ = gated_delta_rule(*args, method="pallas", chunk_size=64)
  np.testing.assert_allclose(np.asarray(full(*args)), np.asarray(want), rtol=1e-6, atol=1e-6)
  bench_ops.main(["--breakdown", "--shapes", "1,64,1,16", "--reps", "1"])
  rows = [l.split("|") for l in capsys.readouterr().out.splitlines() if l.startswith("| 1, 64, 1, 16 |")]
  assert [r[2].strip() for r in rows] == list(bench_ops.STAGES)


def test_fused_output_table_runs_on_cpu(capsys):
  """--fused-output off,on: one row per shape, both settings timed (here in Pallas' interpreter), and the ratios;
  the switch is left as it was."""
  from gdn.ops import pallas_chunk

  before = pallas_chunk.FUSED_OUTPUT
  bench_ops.main(["--fused-output", "off,on", "--shapes", "1,64,1,16", "--reps", "1"])
  out = capsys.readouterr().out.splitlines()
  header = next(l for l in out if l.startswith("| B, T, H, D |"))
  (row,) = [l for l in out if l.startswith("| 1, 64, 1, 16 |")]
  cells = dict(zip([c.strip() for c in header.split("|")[2:-1]], [c.strip() for c in row.split("|")[2:-1]]))
  for col in ("fwd ms off", "fwd ms on", "fwd on / off", "fwd+bwd ms off", "fwd+bwd ms on", "fwd+bwd on / off"):
    assert float(cells[col]) > 0, (col, cells)
  assert pallas_chunk.FUSED_OUTPUT == before


def test_switch_table_runs_on_cpu(capsys):
  """--switch intra_chunk.INVERSE_VJP=off,on: both settings timed side by side and the switch restored; a name
  the module does not have is refused."""
  from gdn.ops import intra_chunk

  before = intra_chunk.INVERSE_VJP
  bench_ops.main(["--switch", "intra_chunk.INVERSE_VJP=off,on", "--shapes", "1,64,1,16", "--reps", "1"])
  out = capsys.readouterr().out.splitlines()
  assert "# intra_chunk.INVERSE_VJP at off, on" in out
  (row,) = [l for l in out if l.startswith("| 1, 64, 1, 16 |")]
  assert "failed" not in row
  assert intra_chunk.INVERSE_VJP == before
  with pytest.raises(SystemExit, match="no setting NOPE"):
    bench_ops.main(["--switch", "intra_chunk.NOPE=off,on", "--shapes", "1,64,1,16", "--reps", "1"])
