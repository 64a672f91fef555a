"""experiments/bench_model.py at a tiny size on CPU (fla needs CUDA: its half is skipped), and its fla model
built at a paper config with the same parameter count as gdn's (on PyTorch's meta device, nothing allocated)."""

import numpy as np
import pytest

from experiments import bench_model

TINY = ["--config", "configs/lm_paper.py:gdn-340m", "--batch", "2", "--seq-len", "16", "--warmup", "1",
        "--steps", "1", "--fla", "off"] + [x for kv in (
            "model.d_model=16", "model.vocab_size=64", "model.recurrent.num_heads=2", "model.recurrent.head_dim=8",
            "model.recurrent.v_head_dim=8", "model.dtype=float32", "model.recurrent.method=recurrent")
            for x in ("--override", kv)]


@pytest.fixture
def fast_compile():
  """The test checks the script, not XLA's fusions: fewer optimisations compile 2-3x faster."""
  import jax

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def test_main_and_depths_tiny(capsys, fast_compile):
  rows = bench_model.main(TINY + ["--override", "model.num_layers=1"])
  assert [r["name"].split()[0] for r in rows] == ["gdn"]
  assert rows[0]["step_ms"] > 0 and np.isfinite(rows[0]["loss"])
  assert "fla: skipped, --fla off" in capsys.readouterr().out
  rows = bench_model.main(TINY + ["--depths", "2"])
  assert [(r["layers"], r["layout"]) for r in rows] == [(2, "scan"), (2, "unrolled")]
  # The same initial parameters and batches: scanned and unrolled training give the same loss.
  scan, unrolled = rows
  np.testing.assert_allclose(scan["loss"], unrolled["loss"], rtol=1e-5)
  assert scan["compile_s"] > 0 and scan["params"] == unrolled["params"]


def test_switch_holds_for_the_run_and_is_put_back(capsys, fast_compile, monkeypatch):
  """--switch sets a module switch under gdn for gdn's run (the header names it) and restores it after; an
  unknown switch stops the script before anything runs."""
  from gdn.ops import pallas_chunk

  seen = []
  run_gdn = bench_model.run_gdn
  default = pallas_chunk.BWD_STATES
  flipped = "on" if not default else "off"
  monkeypatch.setattr(bench_model, "run_gdn", lambda *args: (seen.append(pallas_chunk.BWD_STATES), run_gdn(*args))[1])
  rows = bench_model.main(TINY + ["--override", "model.num_layers=1", "--switch", f"ops.pallas_chunk.BWD_STATES={flipped}"])
  assert seen == [not default] and pallas_chunk.BWD_STATES is default and np.isfinite(rows[0]["loss"])
  assert f"gdn switch ops.pallas_chunk.BWD_STATES={flipped}" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="no setting"):
    bench_model.main(TINY + ["--switch", "ops.pallas_chunk.NO_SUCH=on"])


def test_fla_model_matches_parameter_count():
  torch = pytest.importorskip("torch")
  pytest.importorskip("fla")
  from gdn.bench.model_flops import param_count

  cfg = bench_model.experiment_config(bench_model.parse_args(["--config", "configs/lm_paper.py:gdn-340m"]))
  with torch.device("meta"):
    model = bench_model.fla_model(cfg.model)
  assert sum(p.numel() for p in model.parameters()) == param_count(cfg.model)


def test_flop_count():
  from gdn.config import AttentionConfig, ModelConfig
  from gdn.bench.model_flops import train_flops_per_token

  cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=2, pattern="A", attention=AttentionConfig(2, head_dim=4))
  f = train_flops_per_token(cfg, 10)
  # Untied head: 8 x 100; per layer q, k, v, o 4 x 64, SwiGLU 3 x 8 x 24, two norms of 8; the final norm 8.
  assert f["matmul"] == 6 * (800 + 2 * (256 + 576 + 16) + 8)
  assert f["mixing"] == 2 * 3 * 2 * 10 * 2 * 4


def test_token_file_batch_and_embed_switch(tmp_path, capsys, fast_compile):
  """--token-file takes the batch from a token file (its first batch x (seq_len + 1) tokens, checked against
  the vocabulary); --switch layers.embed.ONEHOT_GRAD=on gives the same loss as the scatter-add gradient."""
  from gdn.layers import embed

  path = tmp_path / "tokens.bin"
  toks = (np.arange(2 * 17 * 3) % 7).astype(np.uint16)  # in range, heavy repeats
  toks.tofile(path)
  a = bench_model.parse_args(TINY + ["--token-file", str(path)])
  np.testing.assert_array_equal(bench_model.tokens(a, 64, "uint16"), toks[:34].reshape(2, 17))
  losses = []
  for setting in ("off", "on"):
    rows = bench_model.main(TINY + ["--override", "model.num_layers=1", "--token-file", str(path),
                                    "--switch", f"layers.embed.ONEHOT_GRAD={setting}"])
    losses.append(rows[0]["loss"])
  assert embed.ONEHOT_GRAD is False  # put back
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  np.arange(10, dtype=np.uint16).tofile(path)
  with pytest.raises(SystemExit, match="fewer than the 34 of one batch"):
    bench_model.tokens(a, 64, "uint16")
  (np.arange(40, dtype=np.uint16) + 60).tofile(tmp_path / "wide.bin")
  with pytest.raises(ValueError):
    bench_model.tokens(bench_model.parse_args(TINY + ["--token-file", str(tmp_path / "wide.bin")]), 64, "uint16")


def test_sweep_model_takes_its_overrides_first():
  """--sweep-model NAME builds that model of the config's sweep (its overrides, then --override's); an unknown
  name is refused with the sweep's models listed."""
  from gdn.train.config import ConfigError

  a = bench_model.parse_args(["--config", "configs/lm_hybrids.py:small", "--sweep-model", "kda_15to1",
                              "--override", "model.num_layers=4"])
  m = bench_model.experiment_config(a).model
  assert m.pattern == "R" * 15 + "A" and m.recurrent.decay == "channel" and m.num_layers == 4
  assert bench_model.experiment_config(bench_model.parse_args(["--config", "configs/lm_hybrids.py:small"])) \
      .model.recurrent.decay != "channel"
  with pytest.raises(ConfigError, match="kda_3to1"):
    bench_model.experiment_config(bench_model.parse_args(["--config", "configs/lm_hybrids.py:small",
                                                          "--sweep-model", "nope"]))


def test_profiling_child_traces_the_timed_model():
  """The --profile child gets every option that shapes gdn's step: it builds the same config (the sweep model
  included: without it the child traced the config's base model under the sweep model's header), the same
  switches, batch and tokens, with fla off."""
  argv = ["--config", "configs/lm_hybrids.py:small", "--sweep-model", "kda_3to1", "--override", "model.num_layers=4",
          "--switch", "ops.pallas_chunk.BWD_STATES=off", "--batch", "3", "--seq-len", "32", "--token-file", "t.bin",
          "--warmup", "1", "--steps", "2", "--profile", "7", "--fla", "on"]
  a = bench_model.parse_args(argv)
  child = bench_model.parse_args(bench_model.child_argv(a))
  assert bench_model.experiment_config(child) == bench_model.experiment_config(a)
  assert bench_model.experiment_config(child).model.recurrent.decay == "channel"
  same = ("config", "sweep_model", "override", "switch", "batch", "seq_len", "token_file", "warmup", "steps", "profile")
  assert {k: getattr(child, k) for k in same} == {k: getattr(a, k) for k in same} and child.fla == "off"


def test_profiling_child_runs_before_this_process_steps(monkeypatch, capsys):
  """The profiling child runs before this process's own gdn step: JAX's allocator keeps what that step used, and
  the child's step beside it ran the 340M model out of an H100's memory."""
  order = []
  monkeypatch.setattr(bench_model, "gdn_profile_in_child",
                      lambda a: order.append("child") or {"error": "not profiled in this test"})
  monkeypatch.setattr(bench_model, "run_gdn", lambda cfg, toks, a: order.append("gdn") or dict(
      compile_s=1.0, step_ms=1.0, xla_bytes=0, peak_bytes=None, loss=1.0))
  rows = bench_model.main(TINY + ["--profile", "3"])
  assert order == ["child", "gdn"]
  assert rows[-1]["profile"] == {"error": "not profiled in this test"}
