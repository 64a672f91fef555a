"""experiments/xla_pass_times.py: per-pass compile time from an XLA dump directory."""

import os
import subprocess
import sys

from experiments import xla_pass_times as xpt


def test_gaps_are_credited_to_the_pass_that_ended(tmp_path):
  names = ["m.jit_f.before_optimizations.txt",
           "m.jit_f.0001.simp.after_algsimp.before_cse.txt",
           "m.jit_f.0002.simp.after_constant_folding.before_dce.txt",
           "m.jit_f.0003.after_layout.after_algsimp.before_fusion.txt",
           "other.jit_g.0001.simp.after_constant_folding.before_dce.txt"]
  for name, t in zip(names, [100.0, 101.0, 131.0, 133.0, 140.0]):
    (tmp_path / name).write_text("x")
    os.utime(tmp_path / name, (t, t))
  assert xpt.pass_of("m.jit_f.0013.copy-insertion.after_adding_copies.txt") == "adding_copies"
  assert xpt.pass_of(names[2]) == "constant_folding" and xpt.pass_of(names[0]) == "before_optimizations.txt"
  assert [f for _, f in xpt.gaps(str(tmp_path), "jit_f")] == names[1:4]
  out = xpt.summary(str(tmp_path), "jit_f")
  rows = [line for line in out.splitlines() if line.startswith("| ") and "seconds" not in line]
  assert rows[0] == "| constant_folding | 30.00 | 91% |" and rows[1] == "| algsimp | 3.00 | 9% |"
  assert "no dump files" in xpt.summary(str(tmp_path), "nothing")


def test_a_real_dump(tmp_path):
  """jax's own compile, dumped after every pass on this machine's backend: the file names parse into passes."""
  code = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.cumsum(x, 0) * 2).lower(jnp.ones((64, 8))).compile()"
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=.*")
  subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
  passes = {xpt.pass_of(f) for _, f in xpt.gaps(str(tmp_path))}
  assert {"layout-assignment", "fusion"} <= passes
  assert "| fusion |" in xpt.summary(str(tmp_path), top=1000)
