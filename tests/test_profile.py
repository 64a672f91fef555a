"""gdn.bench.profile: the device time of a traced step per kernel and per named stage (CPU here: the XLA thunks)."""

import jax
import jax.numpy as jnp
import pytest

from gdn.bench.profile import format_times, jax_kernel_times, stage_of, torch_kernel_times


def test_stage_of_keeps_the_scopes_and_the_side():
  assert stage_of("jit(f)/transpose(jvp(gated_delta_rule))/chunk_local/dot_general") == \
      "bwd: gated_delta_rule/chunk_local"
  assert stage_of("jit(loss)/jvp(short_conv)/slice") == "fwd: short_conv"
  assert stage_of("jit(f)/jvp(gated_delta_rule)/chunk_local/...tk,...ik->...ti/dot_general") == \
      "fwd: gated_delta_rule/chunk_local"
  assert stage_of("jit(f)/add") == "fwd: (no scope)" and stage_of("") == "(unnamed)"


def _step(x, w):
  with jax.named_scope("big"):
    h = jnp.tanh(x @ w)
  with jax.named_scope("small"):
    return jnp.sum(h[:8] * 2.0)


def test_jax_kernel_times_names_the_stages():
  x, w = jnp.ones((1024, 512)), jnp.ones((512, 512))
  compiled = jax.jit(jax.grad(_step, argnums=1)).lower(x, w).compile()
  run = lambda: jax.block_until_ready(compiled(x, w))
  run()
  prof = jax_kernel_times(run, steps=3, hlo_text=compiled.as_text())
  assert prof["steps"] == 3 and prof["total_us"] > 0
  us = [r[0] for r in prof["kernels"]]
  assert us == sorted(us, reverse=True) and abs(sum(us) - prof["total_us"]) < 1e-6 * prof["total_us"] + 1e-9
  stages = {s: t for t, s in prof["stages"]}
  assert any(s.endswith(": big") for s in stages), stages
  assert abs(sum(stages.values()) - prof["total_us"]) < 1e-6 * prof["total_us"] + 1e-9
  table = format_times(prof, top=3, title="t: ")
  assert table.startswith("t: device time per step: ") and "| stage | ms | share |" in table


def test_torch_kernel_times_counts_the_operators():
  torch = pytest.importorskip("torch")
  a = torch.randn(256, 256)
  prof = torch_kernel_times(lambda: (a @ a).sum(), steps=4)
  assert prof["total_us"] > 0 and any("mm" in r[2] for r in prof["kernels"]), prof["kernels"]
  assert all(r[1] > 0 for r in prof["kernels"])


def test_bench_vs_fla_profiles_gdn(capsys):
  from experiments.bench_vs_fla import main
  rows = main(["--preset", "cpu", "--gdn-only", "--shapes", "1,64,1,16", "--reps", "1", "--profile", "4"])
  out = capsys.readouterr().out
  assert "gdn, (1, 64, 1, 16), fwd+bwd: device time per step" in out
  stages = [s for _, s in rows[0]["profiles"]["gdn"]["stages"]]
  assert any("gated_delta_rule/chunk_local" in s for s in stages), stages


def test_bench_model_profiles_the_stages_of_a_training_step(capsys):
  from experiments import bench_model
  from tests.test_bench_model import TINY
  rows = bench_model.main(TINY + ["--override", "model.num_layers=2", "--override", "model.pattern=RA",
                                  "--override", "model.attention.num_heads=2", "--override",
                                  "model.attention.head_dim=8", "--profile", "5"])
  stages = " ".join(s for _, s in rows[0]["profile"]["stages"])
  for stage in ("fwd: recurrent/gated_delta_rule", "bwd: attention", "fwd: mlp", "loss"):
    assert stage in stages, stages
  assert "gdn, one training step: device time per step" in capsys.readouterr().out
