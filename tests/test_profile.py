"""gdn.bench.profile: the device time of a traced step per kernel and per named stage (CPU here: the XLA thunks),
and the benchmark scripts' JAX profiles traced in a child process."""

import subprocess

import jax
import jax.numpy as jnp
import pytest

from gdn.bench import profile
from gdn.bench.profile import (NO_COMMAND_BUFFERS, PARTS, child_env, command_buffers_off, format_times,
                               jax_kernel_times, jax_profile_in_child, part_of, parts, parts_table, read_profiles,
                               stage_of, torch_kernel_times, write_profiles)


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
  # each traced kernel's traffic from the module's shapes, and its bandwidth at the measured time
  assert prof["bytes"] and set(prof["bytes"]) <= {r[3] for r in prof["kernels"]}
  assert "| kernel | launches | ms | share | MB a launch | GB/s | stage |" in table
  us, n, _, op, _ = next(r for r in prof["kernels"] if r[3] in prof["bytes"])
  every = format_times(prof, top=len(prof["kernels"]))
  row = next(line for line in every.splitlines() if f"({op})" in line or f"| {op} |" in line)
  mb, gbs = (float(c) for c in row.split("|")[5:7])
  assert mb == pytest.approx(prof["bytes"][op] / 1e6, abs=0.051)
  assert gbs == pytest.approx(prof["bytes"][op] * n / us / 1e3, rel=0.01, abs=0.51)
  plain = format_times({k: v for k, v in prof.items() if k != "bytes"}, top=3)
  assert "| kernel | launches | ms | share | stage |" in plain and "GB/s" not in plain


def test_torch_kernel_times_counts_the_operators():
  torch = pytest.importorskip("torch")
  a = torch.randn(256, 256)
  prof = torch_kernel_times(lambda: (a @ a).sum(), steps=4)
  assert prof["total_us"] > 0 and any("mm" in r[2] for r in prof["kernels"]), prof["kernels"]
  assert all(r[1] > 0 for r in prof["kernels"])


def test_parts_put_each_sides_kernels_in_the_same_parts_of_the_step():
  """Kernel names and stages as the 340M model's traces have them (results/benchmarks/h100_2026-12-07/
  model_340m_vs_fla_profile.txt): every kernel lands in one part, and the table sets the sides' sums together."""
  R = "eval_jaxpr/recurrent/"
  op = f"bwd: {R}gated_delta_rule"
  gdn = {"kernels": [(43163.0, 21, "gdn_chunk_dstates_bwd", "pallas_call.20", op),
                     (23190.0, 21, "gdn_chunk_states_fwd", "pallas_call.16", op),
                     (11127.0, 21, "gemm_fusion_dot_89", "gemm_fusion_dot.89", op),
                     (106.0, 21, "fusion_1", "fusion.1", "fwd: recurrent/gated_delta_rule/chunk_local"),
                     (603.0, 21, "loop_fusion", "loop_fusion", f"bwd: {R}gates"),
                     (14318.0, 21, "loop_add_fusion_1", "loop_add_fusion.1", f"bwd: {R}short_conv"),
                     (12577.0, 21, "input_convert_reduce_transpose_fusion", "x", f"bwd: {R}out_norm"),
                     (7252.0, 21, "loop_convert_fusion_19", "x", f"fwd: {R}qk_norm"),
                     (12301.0, 21, "input_reduce_fusion", "x", "bwd: eval_jaxpr/norm"),
                     (7800.0, 21, "loop_add_multiply_fusion", "x", "bwd: eval_jaxpr/mlp"),
                     (17456.0, 21, "fusion_9", "fusion.9", "(not in the module)")]}
  fla = {"kernels": [(37615.0, 21, "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", "", ""),
                     (33436.0, 42, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "", ""),
                     (34712.0, 21, "chunk_bwd_kernel_dqkwg", "", ""),
                     (10773.0, 21, "prepare_wy_repr_bwd_kernel", "", ""),
                     (9604.0, 42, "recompute_w_u_fwd_kernel", "", ""),
                     (500.0, 21, "gdn_gate_bwd_kernel", "", ""),
                     (26481.0, 21, "causal_conv1d_bwd_kernel", "", ""),
                     (14144.0, 43, "layer_norm_bwd_kernel_row", "", ""),
                     (8541.0, 21, "layer_norm_gated_bwd_kernel", "", ""),
                     (4214.0, 42, "l2norm_bwd_kernel", "", ""),
                     (29347.0, 127, "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "", ""),
                     (8361.0, 21, "swiglu_fwdbwd_kernel", "", ""),
                     (16823.0, 147, "void at::native::vectorized_elementwise_kernel<4, at::native::add", "", "")]}
  g, f = parts(gdn, "gdn"), parts(fla, "fla")
  assert list(g) == list(PARTS) == list(f)
  us = lambda *v: pytest.approx(sum(v))
  assert g == {"op: state pass": us(43163, 23190), "op: the rest": us(11127, 106, 603), "short conv": us(14318),
               "norms": us(12577, 7252, 12301), "everything else": us(7800, 17456)}
  assert f == {"op: state pass": us(37615, 33436), "op: the rest": us(34712, 10773, 9604, 500),
               "short conv": us(26481), "norms": us(14144, 8541, 4214), "everything else": us(29347, 8361, 16823)}
  assert sum(g.values()) == pytest.approx(sum(r[0] for r in gdn["kernels"]))
  assert part_of("gdn", "loop_fusion", "fwd: eval_jaxpr/mlp") == "everything else"
  with pytest.raises(ValueError, match="side must be"):
    part_of("torch", "x")
  table = parts_table(gdn, fla).splitlines()
  assert table[1] == "| part | gdn | fla | gdn - fla | gdn / fla |"
  assert table[3] == "| op: state pass | 66.353 | 71.051 | -4.698 | 0.93x |", table
  assert table[-1] == "| total | 149.893 | 234.551 | -84.658 | 0.64x |", table
  assert parts_table({"error": "x"}, fla) == "parts: not compared, gdn not profiled"


def test_child_env_turns_command_buffers_off_on_a_gpu_only():
  env = {"XLA_FLAGS": "--xla_gpu_autotune_level=0", "OTHER": "1"}
  gpu = child_env("gpu", env)
  assert gpu == dict(env, XLA_FLAGS=f"--xla_gpu_autotune_level=0 {NO_COMMAND_BUFFERS}") and env["OTHER"] == "1"
  assert child_env("gpu", {})["XLA_FLAGS"] == NO_COMMAND_BUFFERS
  assert child_env("cpu", env) == env and child_env("cpu", env) is not env and "XLA_FLAGS" not in child_env("cpu", {})
  assert command_buffers_off(gpu["XLA_FLAGS"]) and not command_buffers_off(env["XLA_FLAGS"])
  assert not command_buffers_off(f"{NO_COMMAND_BUFFERS} {NO_COMMAND_BUFFERS}FUSION")


def test_profiles_through_json_come_back_as_tuples(tmp_path):
  prof = dict(steps=2, total_us=3.0, kernels=[(3.0, 1.0, "k", "fusion", "fwd: a")], stages=[(3.0, "fwd: a")],
              source="s", command_buffers_off=True)
  write_profiles(str(tmp_path / "p.json"), [prof])
  assert read_profiles(str(tmp_path / "p.json")) == [prof]
  assert "command buffers off" in format_times(prof).splitlines()[0]
  assert "command buffers" not in format_times(dict(prof, command_buffers_off=False))


def test_jax_profile_in_child_passes_the_gpu_flag_and_reads_the_json(monkeypatch):
  seen = {}

  def run(cmd, env, **kw):  # stands in for the child: writes one profile where --profile-json says
    seen.update(cmd=cmd, env=env)
    write_profiles(cmd[cmd.index("--profile-json") + 1], [dict(steps=1, total_us=1.0, kernels=[], stages=[])])
    return subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(profile.subprocess, "run", run)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  (prof,) = jax_profile_in_child("experiments.bench_model", ["--fla", "off"], backend="gpu")
  assert prof["total_us"] == 1.0 and seen["cmd"][1:5] == ["-m", "experiments.bench_model", "--fla", "off"]
  assert seen["env"]["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {NO_COMMAND_BUFFERS}"
  jax_profile_in_child("experiments.bench_model", [], backend="cpu")
  assert seen["env"]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_a_failing_child_gives_its_exit_code_and_stderr():
  (prof,) = jax_profile_in_child("experiments.no_such_script", ["--x"], backend="cpu")
  assert "exited with code 1" in prof["error"] and "No module named experiments.no_such_script" in prof["error"]
  assert format_times(prof, title="gdn: ").startswith("gdn: not profiled: the profiling child")


def test_bench_vs_fla_profiles_gdn_in_a_child(capsys, monkeypatch):
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # the child compiles 2-3x faster
  from experiments.bench_vs_fla import main
  rows = main(["--preset", "cpu", "--gdn-only", "--shapes", "1,64,1,16", "--reps", "1", "--profile", "4"])
  out = capsys.readouterr().out
  assert "gdn, (1, 64, 1, 16), fwd+bwd: device time per step" in out and "command buffers" not in out, out
  prof = rows[0]["profiles"]["gdn"]
  assert "error" not in prof, prof["error"]
  assert prof["total_us"] > 0 and prof["kernels"] and all(isinstance(k, tuple) for k in prof["kernels"])
  stages = [s for _, s in prof["stages"]]
  assert any("gated_delta_rule/chunk_local" in s for s in stages), stages


@pytest.mark.slow
def test_bench_model_profiles_the_stages_of_a_training_step(capsys, monkeypatch):
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # the child compiles 2-3x faster
  from experiments import bench_model
  from tests.test_bench_model import TINY
  rows = bench_model.main(TINY + ["--override", "model.num_layers=2", "--override", "model.pattern=RA",
                                  "--override", "model.attention.num_heads=2", "--override",
                                  "model.attention.head_dim=8", "--profile", "5"])
  stages = " ".join(s for _, s in rows[0]["profile"]["stages"])
  for stage in ("fwd: recurrent/gated_delta_rule", "bwd: attention", "fwd: mlp", "loss"):
    assert stage in stages, stages
  assert "gdn, one training step: device time per step" in capsys.readouterr().out


def _traced_by_op(prof: dict) -> None:
  """A GPU profile traced kernel by kernel: command buffers off, no kernel named by a command buffer, and the
  kernels mapped to stages of the module."""
  assert "error" not in prof, prof["error"]
  assert prof["total_us"] > 0 and prof["command_buffers_off"], {k: v for k, v in prof.items() if k != "kernels"}
  assert not [k for k in prof["kernels"] if "command_buffer" in k[3]], prof["kernels"][:10]
  assert {s for _, s in prof["stages"]} != {"(not in the module)"}, prof["stages"]


@pytest.mark.gpu
def test_bench_vs_fla_profiles_both_sides_on_gpu(capsys):
  """fla traced by torch.profiler in the process, gdn by jax.profiler in a child: both tables filled."""
  pytest.importorskip("torch")
  pytest.importorskip("fla")
  from experiments.bench_vs_fla import main
  (row,) = main(["--shapes", "2,1024,4,128", "--reps", "2", "--profile", "10"])
  print(capsys.readouterr().out)
  assert row["profiles"]["fla"]["total_us"] > 0
  _traced_by_op(row["profiles"]["gdn"])
  assert any("chunk_local" in s for _, s in row["profiles"]["gdn"]["stages"])


@pytest.mark.gpu
def test_bench_model_profiles_gdn_by_stage_on_gpu(capsys):
  from experiments import bench_model
  from tests.test_bench_model import TINY
  (row,) = bench_model.main(TINY + ["--override", "model.num_layers=2", "--profile", "10"])
  print(capsys.readouterr().out)
  _traced_by_op(row["profile"])
  assert any(s.startswith("fwd: recurrent") for _, s in row["profile"]["stages"]), row["profile"]["stages"]
