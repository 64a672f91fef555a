"""experiments/bench_decode.py runs at a tiny size, both decode paths and a scanned hybrid; the operation count of
a compiled loop follows its nesting."""

import jax
import jax.numpy as jnp
import pytest

from experiments.bench_decode import main
from gdn.bench.timing import ops_per_iteration

pytestmark = pytest.mark.usefixtures("fast_compile")  # the tables' shape and the counts' order, not XLA's fusions

TINY = ["--d-model", "32", "--layers", "4", "--heads", "2", "--head-dim", "8", "--vocab", "32", "--steps", "2",
        "--reps", "1", "--contexts", "8,16"]


@pytest.mark.slow
def test_bench_decode_table(capsys):
  # One batch size (2, so that tokens/s counts the batch): the batch is a loop over the same code as a context.
  # One pattern, the hybrid (its recurrent layers are the R model's).
  main(TINY + ["--patterns", "RRRA", "--paths", "plain,lean,lean_unrolled", "--batches", "2", "--scan-layers"])
  lines = capsys.readouterr().out.splitlines()
  first = lines.index(next(line for line in lines if line.startswith("| pattern |"))) + 2
  rows = [line.strip("| ").split(" | ") for line in lines[first:lines.index("", first)]]
  assert len(rows) == 1 * 3 * 1 * 2  # patterns x paths x batches x contexts
  for pattern, path, batch, context, ms, tps, floor, ratio, ops in rows:
    # ms is printed to 3 decimals, tokens/s from the unrounded value; the floor of this tiny model rounds to 0.
    assert float(ms) > 0 and float(floor) >= 0 and ratio.endswith("x")
    assert abs(float(tps) * float(ms) / (int(batch) * 1e3) - 1) < 0.02
  ops = {(r[0], r[1]): int(r[8]) for r in rows}
  assert ops["RRRA", "lean"] < ops["RRRA", "plain"]  # the fused projections
  assert ops["RRRA", "lean_unrolled"] < ops["RRRA", "lean"]  # no per-layer weight slices


def test_bench_decode_kernel_paths(capsys):
  """"lean_xla", "lean_kernel" and "lean_split" time the lean model with the fused decode kernel forced off, on,
  and on over value blocks (here in Pallas' interpreter), and leave the switches as they were."""
  from gdn.ops import pallas_decode

  before = pallas_decode.DECODE_KERNEL, pallas_decode.SPLIT_V
  main(TINY[:-1] + ["8", "--patterns", "R", "--paths", "lean_xla,lean_kernel,lean_split", "--batches", "1"])
  lines = capsys.readouterr().out.splitlines()
  rows = [line for line in lines if line.startswith("| R | lean_")]
  assert [r.split(" | ")[1] for r in rows[:3]] == ["lean_xla", "lean_kernel", "lean_split"]
  assert (pallas_decode.DECODE_KERNEL, pallas_decode.SPLIT_V) == before


def test_bench_decode_mlp_width_and_xla_options(capsys):
  """--mlp-hidden sets the SwiGLU width (narrower than d_model 32's default of 88: fewer weight bytes), the lean
  MLPs are widened with zeros to a multiple of 256 unless --mlp-multiple 1, and --xla-option reaches the compiler:
  an unknown option fails the row with XLA's message, a known one times it."""
  args = TINY[:-1] + ["8", "--patterns", "R", "--paths", "lean", "--batches", "1"]
  keep = ["--mlp-multiple", "1"]
  main(args + keep)
  main(args + keep + ["--mlp-hidden", "64", "--xla-option", "xla_cpu_enable_fast_math=false"])
  main(args + keep + ["--xla-option", "xla_no_such_option=1"])
  main(args)  # 88 -> 256 with zeros: more bytes read, the same model
  out = capsys.readouterr().out
  heads = [line for line in out.splitlines() if line.startswith("# decode")]
  weights = [float(h.rsplit("weights R ", 1)[1].split()[0]) for h in heads]  # MiB
  assert "SwiGLU width 64, xla_cpu_enable_fast_math=False" in heads[1]
  assert weights[1] < weights[0] == weights[2] < weights[3]
  assert "widened" not in heads[0] and "lean MLPs widened to a multiple of 256" in heads[3]
  rows = [line for line in out.splitlines() if line.startswith("| R | lean | 1 | 8 |")]
  timed = [r for r in rows if "x | " in r]  # the timing table's rows: their ms / floor ends in "x"
  assert len(timed) == 3 and any("failed" in r for r in rows) and "xla_no_such_option" in out


def test_bench_decode_profile(capsys):
  """--profile traces each timed row once more: a row of device time per token (kernels, matmuls and the rest,
  whose sum is the kernels'), then the row's kernels, the dots among the matmuls."""
  from experiments.bench_decode import is_matmul

  main(TINY[:-1] + ["8", "--patterns", "R", "--paths", "lean", "--batches", "1", "--profile", "--profile-top", "5"])
  out = capsys.readouterr().out
  assert "Device time per token by kind" in out
  row = next(line for line in out.splitlines() if line.startswith("| R | lean | 1 | 8 |") and "(" in line)
  timed, kernels, mm, other, idle = [c.strip() for c in row.split(" | ")[4:9]]
  assert float(timed) > 0 and float(kernels) > 0 and float(mm.split()[0]) > 0
  assert abs(float(mm.split()[0]) + float(other.split()[0]) - float(kernels)) < 2e-3
  assert abs(float(timed) - float(kernels) - float(idle.rstrip(" |"))) < 2e-3
  assert "R | lean | 1 | 8: device time per token:" in out and "divided by 2" in out
  assert is_matmul("sm90_xmma_gemm_bf16bf16", "") and is_matmul("", "gemm_fusion_dot.3")
  assert is_matmul("dot.104", "") and not is_matmul("loop_add_fusion", "fusion.12")


def test_bench_decode_switch_rows(capsys):
  """--switch times each path under each value (rows "path NAME=value"), sets the switch while each row's program
  is traced and restores it; an unknown switch is refused before anything compiles."""
  from gdn.layers import fused

  before = fused.PAD_SINGLE_ROW
  main(TINY[:-1] + ["8", "--patterns", "R", "--paths", "lean", "--batches", "1",
                    "--switch", "layers.fused.PAD_SINGLE_ROW=off,on"])
  rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| R | lean")]
  timed = [r[1] for r in rows if r[7].endswith("x")]
  assert timed == ["lean PAD_SINGLE_ROW=off", "lean PAD_SINGLE_ROW=on"] and fused.PAD_SINGLE_ROW == before
  with pytest.raises(SystemExit, match="no setting"):
    main(TINY + ["--patterns", "R", "--switch", "layers.fused.NO_SUCH=on"])


def test_xla_options_parse_and_refuse_malformed():
  import argparse

  from experiments.bench_decode import parse_xla_options

  p = argparse.ArgumentParser()
  assert parse_xla_options(p, ["a=true", "b=False", "c=12", "d=FUSION,CUBLAS"]) == dict(
      a=True, b=False, c=12, d="FUSION,CUBLAS")
  with pytest.raises(SystemExit):
    parse_xla_options(p, ["no_value"])


def test_ops_per_iteration_counts_nested_loops_by_trip_count():
  def ops(n_inner):
    def f(x, w):
      inner = lambda x: jax.lax.fori_loop(0, n_inner, lambda i, y: jnp.tanh(y @ w), x)
      return jax.lax.fori_loop(0, 100, lambda i, y: jnp.cos(inner(y)) @ w, x)
    return ops_per_iteration(jax.jit(f).lower(jnp.ones((4, 64)), jnp.ones((64, 64))).compile())

  # Loops this long stay loops: each inner iteration adds the same operations.
  ten, thirty = ops(10), ops(30)
  assert 0 < ten < thirty and (thirty - ten) % 20 == 0
