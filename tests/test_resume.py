"""What a launch does with its work directory: the lock, a config its checkpoints do not fit (refused, or
train.resume="fresh" / "params_only"), checkpoints that are all damaged (stop, listing them), and a step with a
non-finite loss (stop, or skip up to a limit).

One tiny attention model; the runs share one work directory where they can, since each compiles its steps."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from experiments import train as train_cli
from gdn.train import ConfigError, checkpoint, loop, optimizer, step, train, workdir
from gdn.train.config_file import resolve
from gdn.train.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart.py")
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.usefixtures("fast_compile")]  # fewer optimisations compile faster (conftest.py)
TINY = [
    "model.d_model=16", "model.num_layers=1", "model.pattern=A", "model.vocab_size=64",
    "model.attention.num_heads=2", "model.attention.head_dim=8", "data.batch_size=4",
    "data.mqar.vocab_size=64", "data.mqar.train_settings=((16,2),)", "data.mqar.eval_settings=((16,2),)",
    "data.mqar.eval_examples=4", "train.steps=100", "train.warmup_steps=1", "train.log_every=1",
    "train.eval_every=0", "train.checkpoint_every=2", "train.progress_bar=false", "train.stop_step=4",
]


def _cfg(wd, *overrides):
  return resolve(CONFIG, [*TINY, f"workdir={wd}", *overrides])


def _params(directory, cfg):
  tx = optimizer.make_optimizer(cfg.train)
  template = step.init(cfg.model, tx, cfg.seed)[1]
  ck = checkpoint.Checkpoints(directory, 3)
  try:
    state, _, at = ck.restore_latest(template)
  finally:
    ck.close()
  return at, jax.tree_util.tree_leaves(state.params)


def test_resume_refuses_a_changed_config_unless_asked_and_the_lock_refuses_a_second_run(tmp_path):
  wd = str(tmp_path / "run")
  train(_cfg(wd), log=lambda *a: None)

  # Every differing key is named, with the switches that would accept it; nothing in the workdir changes.
  before = sorted(os.listdir(wd))
  with pytest.raises(checkpoint.ConfigMismatch) as e:
    train(_cfg(wd, "seed=3", "train.learning_rate=0.5"))
  assert "seed: 0 -> 3" in str(e.value) and "train.learning_rate: 0.003 -> 0.5" in str(e.value)
  assert "train.resume=fresh" in str(e.value) and "train.resume=params_only" in str(e.value)
  assert sorted(os.listdir(wd)) == before

  # Longer, with another cadence: resumable keys, so it continues from step 4.
  lines = []
  train(_cfg(wd, "train.stop_step=6", "train.log_every=2"), log=lines.append)
  assert "resumed from step 4" in " ".join(lines)
  assert sorted(r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "train/loss" in r) == \
      [1, 2, 3, 4, 6]
  at, trained = _params(os.path.join(wd, "checkpoints"), _cfg(wd))
  assert at == 6

  # params_only: a new optimizer (and learning rate) from step 0 on the old run's newest parameters, the old
  # run moved to previous/1; relaunching the same command finds the new run (here finished) instead of starting
  # again.
  new = _cfg(wd, "train.learning_rate=0.5", "train.resume=params_only", "train.stop_step=2",
             "train.checkpoint_every=0")
  seen = []
  with pytest.MonkeyPatch.context() as mp:  # the state the run starts from, as it goes onto the mesh
    shard_state = loop.sharding.shard_state
    copy = lambda state: (int(state.step), [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)])
    mp.setattr(loop.sharding, "shard_state", lambda state, mesh: seen.append(copy(state)) or shard_state(state, mesh))
    train(new, log=lambda *a: None)
  start, trained_leaves = seen[0]
  assert start == 0
  for a, b in zip(trained_leaves, trained):
    np.testing.assert_array_equal(a, b)
  assert os.listdir(os.path.join(wd, "previous")) == ["1"]
  assert _params(os.path.join(wd, "previous", "1", "checkpoints"), _cfg(wd))[0] == 6
  assert sorted(r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "train/loss" in r) == [1, 2]
  lines = []
  train(new, log=lines.append)
  assert "finished already at step 2" in " ".join(lines) and os.listdir(os.path.join(wd, "previous")) == ["1"]

  # fresh: the old run is set aside again and the new one starts from step 0.
  train(_cfg(wd, "seed=3", "train.resume=fresh", "train.stop_step=2", "train.checkpoint_every=0"))
  assert sorted(os.listdir(os.path.join(wd, "previous"))) == ["1", "2"]
  with open(os.path.join(wd, "config.json")) as f:
    assert json.load(f)["seed"] == 3

  # A live run's lock: a second launch on the directory is refused, naming the holder's pid.
  held = workdir.Lock(wd)
  try:
    with pytest.raises(workdir.WorkdirLocked, match=f"pid {os.getpid()}"):
      train(_cfg(wd, "seed=3", "train.resume=fresh", "train.stop_step=2", "train.checkpoint_every=0"))
  finally:
    held.release()
  assert sorted(os.listdir(os.path.join(wd, "previous"))) == ["1", "2"]


def test_a_workdir_whose_every_checkpoint_is_damaged_stops_listing_them(tmp_path, capsys):
  wd = str(tmp_path / "run")
  cfg = _cfg(wd)
  template = step.init(cfg.model, optimizer.make_optimizer(cfg.train), cfg.seed)[1]
  ck = checkpoint.Checkpoints(os.path.join(wd, "checkpoints"), 3)
  for s in (2, 4):
    ck.save(s, template, {"next_index": s})
  ck.close()
  for s in (2, 4):  # positions moved by hand: the digest no longer matches
    with open(os.path.join(wd, "checkpoints", str(s), "data", "metadata"), "w") as f:
      json.dump({"next_index": 40}, f)

  args = ["--config", CONFIG, *(f"--config.{o}" for o in TINY), f"--config.workdir={wd}",
          "--config.compilation_cache="]
  with pytest.warns(UserWarning, match="corrupt or partial"):
    assert train_cli.main(args) == 2
  err = capsys.readouterr().err
  for s in (4, 2):
    assert f"step {s} (" in err and f"moved to {os.path.join(wd, 'corrupt_checkpoints', str(s))})" in err
  assert "train.resume=fresh" in err
  assert not os.path.exists(os.path.join(wd, "metrics.jsonl"))  # nothing was trained from step 0


def _poison(monkeypatch, bad_batches):
  """Training batches `bad_batches` (0-based) get NaN weights, hence a NaN loss and gradient."""
  make_task = loop.make_task

  def poisoned(*args, **kwargs):
    task = make_task(*args, **kwargs)

    def nan_weights(i, batch):
      return {**batch, "weights": batch["weights"] * np.nan} if i in bad_batches else batch

    return dataclasses.replace(task, train=task.train.map_with_index(nan_weights))

  monkeypatch.setattr(loop, "make_task", poisoned)


def test_a_non_finite_step_stops_the_run_before_a_save_or_is_skipped_up_to_the_limit(tmp_path, monkeypatch,
                                                                                     capsys):
  wd = str(tmp_path / "run")
  _poison(monkeypatch, {2, 4})  # steps 3 and 5

  # Default: the CLI stops at step 3 with exit status 3; the checkpoint of step 2 is the last one.
  args = ["--config", CONFIG, *(f"--config.{o}" for o in TINY), f"--config.workdir={wd}",
          "--config.train.stop_step=6", "--config.compilation_cache="]  # no cache for the rest of the session
  assert train_cli.main(args) == 3
  err = capsys.readouterr().err
  assert "step 3: loss nan" in err and "step 2" in err and "skip_nonfinite" in err
  assert sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == [2]

  # skip_nonfinite=1 (resumable): step 3's update is dropped, the run goes on and stops at step 5.
  with pytest.raises(loop.NonFiniteLoss, match="step 5"):
    train(_cfg(wd, "train.stop_step=6", "train.skip_nonfinite=1"), log=lambda *a: None)
  rows = {r["step"]: r for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "train/loss" in r}
  assert [s for s, r in sorted(rows.items()) if r["train/nonfinite"]] == [3, 5]
  assert all(np.isfinite(r["train/loss"]) for s, r in rows.items() if s not in (3, 5))
  at, params = _params(os.path.join(wd, "checkpoints"), _cfg(wd))
  assert at == 4 and all(np.isfinite(p).all() for p in params)

  # With two allowed it finishes; the checkpoint after the skipped step holds finite parameters.
  summary = train(_cfg(wd, "train.stop_step=6", "train.skip_nonfinite=2"), log=lambda *a: None)
  assert summary["steps"] == 6 and np.isfinite(summary["eval"]["loss"])


def test_the_train_step_drops_a_non_finite_update():
  cfg = _cfg("unused")
  tx = optimizer.make_optimizer(cfg.train)
  graphdef, state = step.init(cfg.model, tx, cfg.seed)
  train_step = step.make_train_step(graphdef, tx, optimizer.lr_shape(cfg.train))
  tokens = np.ones((2, 8), np.int32)
  batch = dict(inputs=tokens, targets=tokens, weights=np.full((2, 8), np.nan, np.float32))
  before = [np.asarray(x) for x in jax.tree_util.tree_leaves((state.step, state.params, state.opt_state))]
  after, m = train_step(state, batch)
  assert float(m["nonfinite"]) == 1.0 and not np.isfinite(float(m["loss"]))
  for a, b in zip(jax.tree_util.tree_leaves((after.step, after.params, after.opt_state)), before):
    np.testing.assert_array_equal(a, b)
  tokens = np.ones((2, 8), np.float32)
  after, m = train_step(after, dict(batch, weights=tokens))
  assert float(m["nonfinite"]) == 0.0 and int(after.step) == 1


def test_config_differences_name_keys_and_treat_a_missing_key_as_its_default():
  base = workdir.as_json(_cfg("a"))
  saved = json.loads(json.dumps(base))
  del saved["train"]["skip_nonfinite"], saved["model"]["d_model"]  # keys the run's code did not have yet
  saved["model"]["retired_field"] = 1  # a key the code no longer has
  new = workdir.as_json(_cfg("b", "model.num_layers=2", "train.b2=0.99", "train.eval_every=5",
                             "sweep.seeds=(0,1)"))
  assert workdir.differences(saved, new) == {"model.d_model": (128, 16), "model.num_layers": (1, 2),
                                             "train.b2": (0.95, 0.99)}


def test_a_finished_or_early_stopped_run_launched_again_is_left_as_it_ended(tmp_path):
  """The same command after the end (a rerun, a sweep's next piece) trains nothing and logs nothing; a run killed
  between its early stop's checkpoint and its summary stops there again instead of training on."""
  lines = lambda wd: open(os.path.join(wd, "metrics.jsonl")).read()
  wd = str(tmp_path / "finished")
  first = train(_cfg(wd))
  logged = lines(wd)
  messages = []
  assert train(_cfg(wd), log=messages.append) == first
  assert lines(wd) == logged and any("finished already at step 4" in m for m in messages)

  # Early stop at the first evaluation (every loss reaches 1e-6), at step 2 of a run that would go to 4.
  wd = str(tmp_path / "early")
  early = ("train.eval_every=2", "train.early_stop=1e-6", "train.early_stop_metric=loss")
  first = train(_cfg(wd, *early))
  assert first["steps"] == 2 and first["stopped_early"]
  logged = lines(wd)
  assert train(_cfg(wd, *early)) == first and lines(wd) == logged
  assert sorted(d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == ["2"]
  os.remove(os.path.join(wd, "summary.json"))  # as a kill after the checkpoint, before the summary
  again = train(_cfg(wd, *early))
  assert again["steps"] == 2 and again["stopped_early"] and again["eval"] == first["eval"]
  assert lines(wd) == logged
  assert sorted(d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == ["2"]

  with pytest.raises(ConfigError, match="early_stop_metric 'acc' is not an eval metric"):
    train(_cfg(str(tmp_path / "typo"), "train.early_stop=0.5", "train.early_stop_metric=acc"))


def test_tokens_per_second_counts_the_tokens_of_the_steps_it_reports(tmp_path):
  """Every logged step has a rate, also one logged right after another (each step's tokens are counted when its
  metrics are read, not when it is dispatched)."""
  wd = str(tmp_path / "rate")
  train(_cfg(wd, "train.checkpoint_every=1", "train.eval_every=1"))
  rates = [r["train/tokens_per_s"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "train/loss" in r]
  assert len(rates) == 4 and all(r > 0 for r in rates), rates


def test_launch_times_keep_each_launch_up_to_the_checkpoint_resumed_from(tmp_path):
  """launches.json: each launch's seconds at its checkpoints; a relaunch from step s keeps every earlier launch
  up to its last checkpoint at or before s (one saved later, but not the one restored, does not count) and
  drops launches that began at s or after."""
  d = str(tmp_path)
  first = workdir.LaunchTimes(d, 0, t0=100.0)
  for s, now in ((10, 110.0), (20, 120.0), (30, 130.0)):
    first.mark(s, now)
  # Killed after step 30's checkpoint was marked but before it was complete: the relaunch restores step 20.
  second = workdir.LaunchTimes(d, 20, t0=500.0)
  assert second.launches == 2 and second.total(505.0) == 20.0 + 5.0
  second.mark(30, 530.0)
  second.mark(40, 540.0)
  with open(os.path.join(d, "launches.json")) as f:
    assert [(e["from_step"], e["to_step"], e["seconds"]) for e in json.load(f)] == [(0, 20, 20.0), (20, 40, 40.0)]
  # Step 40's checkpoint is damaged: a third launch from step 30 keeps the second launch up to 30.
  third = workdir.LaunchTimes(d, 30, t0=900.0)
  assert third.launches == 3 and third.total(901.0) == 20.0 + 30.0 + 1.0
  # A launch from step 20 again drops the second launch, which began there.
  assert workdir.LaunchTimes(d, 20, t0=0.0).launches == 2
  assert workdir.LaunchTimes(d, 0, t0=0.0).launches == 1  # a fresh start counts nothing before it
  with open(os.path.join(d, "launches.json"), "w") as f:
    f.write("not json")
  assert workdir.LaunchTimes(d, 20, t0=0.0).launches == 1  # unreadable: this launch's seconds only
