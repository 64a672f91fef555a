"""experiments/bench_scaling.py runs on 4 forced CPU devices: a table row per device count, and the first loss of
the sharded step (parameters split over every device) equals one device's on the same global batch."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(args):
  """bench_scaling's rows (dicts by column) in a child process with its forced CPU devices."""
  code = f"import sys; sys.path.insert(0, {ROOT!r}); from experiments.bench_scaling import main; main({args!r})"
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  # The script forces its own device count; the caller's other flags (conftest.py's code generation) stay.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # the table and the losses are under test, not XLA's fusions
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  lines = [line for line in r.stdout.splitlines() if line.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]], r.stdout


def test_bench_scaling_table_on_4_cpu_devices():
  # Three device counts are three compilations of the step, most of the test's time: one attention layer, which
  # compiles fastest (tests/test_sharding.py shards the recurrent layers).
  args = ["--cpu-devices", "4", "--fsdp", "n", "--mixer", "attention", "--layers", "1", "--d-model", "32",
          "--vocab", "64", "--seq-len", "16", "--per-device-batch", "2", "--warmup", "1", "--steps", "2"]
  rows, out = _table(args)
  assert [int(row["devices"]) for row in rows] == [1, 2, 4], out
  assert [row["mesh (data x fsdp x seq)"] for row in rows] == ["1x1x1", "1x2x1", "1x4x1"]
  assert [int(row["global batch"]) for row in rows] == [2, 4, 8]
  for row in rows:
    assert float(row["loss rel diff"]) <= 1e-5, row
    assert float(row["step ms"]) > 0 and float(row["tokens/s"].replace(",", "")) > 0


def test_context_parallel_rows_split_each_sequence():
  """--seq 2: at 2 devices each sequence's time axis is split over both (the per-device batch's rows shared by
  the two, the same global batch as one device), and the first loss equals one device's on whole sequences."""
  args = ["--cpu-devices", "2", "--devices", "1,2", "--seq", "2", "--mixer", "gated_deltanet", "--pattern", "R",
          "--layers", "1", "--d-model", "32", "--vocab", "64", "--seq-len", "32", "--per-device-batch", "2",
          "--warmup", "1", "--steps", "1"]
  rows, out = _table(args)
  assert [row["mesh (data x fsdp x seq)"] for row in rows] == ["1x1x1", "1x1x2"], out
  assert [int(row["global batch"]) for row in rows] == [2, 2]
  for row in rows:
    assert float(row["loss rel diff"]) <= 1e-5, row
  assert "split over the seq axis where it has 2 devices" in out
