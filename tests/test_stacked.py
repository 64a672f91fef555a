"""Stacked training (gdn/train/stacked.py): cells that differ in seed and learning rate trained as one vmapped
program log the losses that separate `train` runs log, write the same files, resume exactly after a crash, stop
early one by one, refuse cells that differ in anything else, and run a sweep through `gdn-compare --stack`."""

import dataclasses
import json
import os

import numpy as np
import pytest

from configs import base
from experiments import compare
from gdn.sweep import grid
from gdn.train import ConfigError, metrics, stacked, train
from gdn.train.config_file import apply_overrides, load, resolve
from gdn.train.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Orbax's async checkpointer may leave its event loop to close after a test ends.
# The runs check what is logged, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.usefixtures("fast_compile")]
# A 2-layer Gated DeltaNet + attention model of width 16 on MQAR with 16 tokens: 16 steps, an evaluation and a
# checkpoint every 4, on a schedule of 100 steps.
TINY = [
    *base.width(16), "model.num_layers=2", "model.pattern=RA", "model.vocab_size=64",
    "model.recurrent.method=recurrent", "data.batch_size=4", "data.mqar.vocab_size=64",
    "data.mqar.train_settings=((16,2),)", "data.mqar.eval_settings=((16,2),)", "data.mqar.eval_examples=8",
    "train.steps=100", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=4",
    "train.checkpoint_every=4", "train.progress_bar=false", "train.stop_step=16", "compilation_cache=",
]
QUIET = lambda *a: None


def _cfg(root, seed, lr, *overrides):
  name = f"s{seed}_lr{lr:g}"
  return resolve(os.path.join(ROOT, "configs", "quickstart.py"),
                 [*TINY, f"seed={seed}", f"train.learning_rate={lr}", f"name={name}",
                  f"workdir={os.path.join(str(root), 'runs', name)}", *overrides])


def _records(cfg):
  """{step: every metric logged at it} (train and eval metrics are separate lines)."""
  out = {}
  for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")):
    out.setdefault(r["step"], {}).update(r)
  return out


def _summary(cfg):
  with open(os.path.join(cfg.run_dir, "summary.json")) as f:
    return json.load(f)


def _same_as_alone(tmp_path, cells, *overrides, steps=16, evals=(4, 8, 12, 16)):
  """Trains `cells` (seed, rate) stacked, then each alone, and compares what they logged and summarised. No
  checkpoints (saving them is most of these tiny runs' time; the resume test covers them)."""
  overrides = ("train.checkpoint_every=0",) + overrides
  stacked.train_stacked([_cfg(tmp_path / "stacked", s, lr, *overrides) for s, lr in cells], log=QUIET)
  for s, lr in cells:
    alone, together = _cfg(tmp_path / "alone", s, lr, *overrides), _cfg(tmp_path / "stacked", s, lr, *overrides)
    train(alone, log=QUIET)
    a, b = _records(alone), _records(together)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert all(a[k].keys() == b[k].keys() for k in a)  # train/tokens_per_s and the eval keys included
    assert os.listdir(os.path.join(together.run_dir, "tb"))
    # vmap batches the matmuls, which may sum in another order than the unbatched step: the same numbers up to
    # float32 rounding (measured on XLA:CPU: at most 1.2e-7 relative in the loss and 6.3e-7 in the gradient norm
    # over 16 steps of 3 cells), hence rtol 1e-5 rather than equality.
    for k in ("train/loss", "train/accuracy", "train/grad_norm", "train/lr"):
      np.testing.assert_allclose([b[i][k] for i in sorted(a)], [a[i][k] for i in sorted(a)], rtol=1e-5, err_msg=k)
    for i in evals:
      np.testing.assert_allclose(b[i]["eval/loss"], a[i]["eval/loss"], rtol=1e-5)
      assert b[i]["eval/accuracy"] == a[i]["eval/accuracy"]
    sa, sb = _summary(alone), _summary(together)
    assert sa.keys() == sb.keys() and sb["steps"] == steps and not sb["stopped_early"]
    assert sb["params"] == sa["params"]
    assert grid.done(grid.Cell("m", "s", s, lr, together))


@pytest.mark.slow
def test_stacked_cells_log_what_separate_runs_log(tmp_path, monkeypatch):
  """Two cells of one seed (their batches the same) share one data iterator; the third has its own."""
  made = []
  make = stacked.iterator
  monkeypatch.setattr(stacked, "iterator", lambda *a, **k: made.append(1) or make(*a, **k))
  _same_as_alone(tmp_path, [(0, 3e-3), (0, 1e-2), (2, 1e-3)])
  assert len(made) == 2


@pytest.mark.slow
def test_batches_of_different_lengths_are_padded_without_changing_the_losses(tmp_path):
  mixture = ("data.mqar.train_settings=((8,1),(16,2))", "train.stop_step=6", "train.eval_every=0")
  cells = [(0, 3e-3), (1, 1e-2)]
  # The two cells draw batches of different lengths at some step, so the stacked batch pads one of them.
  lengths = [[b["inputs"].shape[1] for b in stacked.load_task(_cfg(tmp_path, s, lr, *mixture)).train]
             for s, lr in cells]
  assert lengths[0] != lengths[1], lengths
  _same_as_alone(tmp_path, cells, *mixture, steps=6, evals=(6,))


def _killed_at(monkeypatch, cfgs, at: int):
  """Trains `cfgs` stacked until the first metrics of step `at` are written, where the run dies (an exception
  out of the writer, as a crash between two checkpoints)."""
  write = metrics.MetricWriter.write

  class Killed(Exception):
    pass

  def killed(self, step, prefix, values):
    if step == at:
      raise Killed
    write(self, step, prefix, values)

  monkeypatch.setattr(metrics.MetricWriter, "write", killed)
  with pytest.raises(Killed):
    stacked.train_stacked(cfgs, log=QUIET)
  monkeypatch.setattr(metrics.MetricWriter, "write", write)


def test_an_interrupted_group_resumes_exactly_and_a_finished_one_trains_nothing(tmp_path, monkeypatch):
  cells = [(0, 3e-3), (1, 1e-2)]
  stacked.train_stacked([_cfg(tmp_path / "full", s, lr) for s, lr in cells], log=QUIET)
  cfgs = [_cfg(tmp_path / "crashed", s, lr) for s, lr in cells]

  _killed_at(monkeypatch, cfgs, 10)
  assert not any(os.path.exists(os.path.join(c.run_dir, "summary.json")) for c in cfgs)
  ckdir = os.path.join(stacked.group_dir(cfgs), "checkpoints")
  assert sorted(int(d) for d in os.listdir(ckdir) if d.isdigit()) == [4, 8]

  lines = []
  stacked.train_stacked(cfgs, log=lines.append)
  assert "resumed 2 stacked cells from step 8" in "\n".join(lines)
  for s, lr in cells:
    full, resumed = _records(_cfg(tmp_path / "full", s, lr)), _records(_cfg(tmp_path / "crashed", s, lr))
    assert sorted(resumed) == sorted(full) == list(range(1, 17))
    for i in full:  # the same program on the same data from the same state: exactly equal
      assert resumed[i]["train/loss"] == full[i]["train/loss"], i
      assert resumed[i].get("eval/loss") == full[i].get("eval/loss"), i
  # Each cell's seconds over both launches: the first's up to its checkpoint at step 8, then this one's.
  for c in cfgs:
    summary = _summary(c)
    with open(os.path.join(c.run_dir, "launches.json")) as f:
      spans = [(e["from_step"], e["to_step"]) for e in json.load(f)]
    assert spans == [(0, 8), (8, 16)] and summary["launches"] == 2
    assert summary["seconds_total"] > summary["seconds"] > 0
  alone = _summary(_cfg(tmp_path / "full", *cells[0]))
  assert alone["launches"] == 1 and alone["seconds_total"] == alone["seconds"]

  # Every cell has finished: a relaunch reads their summaries back and trains nothing.
  before = [open(os.path.join(c.run_dir, "metrics.jsonl")).read() for c in cfgs]
  lines = []
  summaries = stacked.train_stacked(cfgs, log=lines.append)
  assert [s["steps"] for s in summaries] == [16, 16] and summaries == [_summary(c) for c in cfgs]
  assert before == [open(os.path.join(c.run_dir, "metrics.jsonl")).read() for c in cfgs] and not lines


# At lr 1e-2 the tiny model gets 2 of the 16 eval tokens right by step 8 (measured); at 1e-4 it gets none in 16
# steps. Only the first cell reaches an eval accuracy of 0.1.
EARLY_STOP_CELLS = ((2, 1e-2), (0, 1e-4))


@pytest.fixture(scope="module")
def early_stop_group(tmp_path_factory, fast_compile):
  """The two cells above trained stacked with train.early_stop=0.1, uninterrupted, once for the module: their
  configs, the summaries train_stacked returned and the lines it logged."""
  root = tmp_path_factory.mktemp("early_stop")
  cfgs = [_cfg(root, s, lr, "train.early_stop=0.1") for s, lr in EARLY_STOP_CELLS]
  lines = []
  summaries = stacked.train_stacked(cfgs, log=lines.append)
  return cfgs, summaries, lines


def test_a_cell_that_reaches_the_target_stops_while_the_others_go_on(tmp_path, early_stop_group):
  (fast, slow), summaries, lines = early_stop_group
  assert "1 of 2 stacked cells still training: stacked again as a program of 1" in lines  # SHRINK
  stop = min(s for s, r in _records(fast).items() if r.get("eval/accuracy", 0.0) >= 0.1)
  assert stop < 16
  assert summaries[0]["stopped_early"] and summaries[0]["steps"] == stop == max(_records(fast))
  assert summaries[0]["eval"]["accuracy"] == _records(fast)[stop]["eval/accuracy"]
  assert not summaries[1]["stopped_early"] and summaries[1]["steps"] == 16 == max(_records(slow))
  assert summaries == [_summary(fast), _summary(slow)]
  assert all(grid.done(grid.Cell("m", "s", c.seed, c.train.learning_rate, c)) for c in (fast, slow))
  # The slow cell trains as it would alone: its frozen neighbour does not disturb it.
  alone = _cfg(tmp_path / "alone", 0, 1e-4, "train.early_stop=0.1")
  train(alone, log=QUIET)
  np.testing.assert_allclose([_records(slow)[i]["train/loss"] for i in range(1, 17)],
                             [_records(alone)[i]["train/loss"] for i in range(1, 17)], rtol=1e-5)


def test_a_shrunk_group_resumes_exactly(tmp_path, monkeypatch, early_stop_group):
  """A group killed after its fast cell ended and the program shrank (SHRINK) resumes from its checkpoint, which
  holds both cells, as the shrunk program: the slow cell's losses equal the uninterrupted run's exactly."""
  full = early_stop_group[0]  # the first stops at an eval accuracy of 0.1 by step 8 (as above), the second not
  assert _summary(full[0])["steps"] <= 8
  cfgs = [_cfg(tmp_path / "crashed", s, lr, "train.early_stop=0.1") for s, lr in EARLY_STOP_CELLS]
  _killed_at(monkeypatch, cfgs, 14)
  lines = []
  stacked.train_stacked(cfgs, log=lines.append)
  assert "resumed 2 stacked cells from step 12" in "\n".join(lines)
  assert "1 of 2 stacked cells still training: stacked again as a program of 1" in lines
  a, b = _records(full[1]), _records(cfgs[1])
  assert sorted(a) == sorted(b) == list(range(1, 17))
  assert all(b[i]["train/loss"] == a[i]["train/loss"] and b[i].get("eval/loss") == a[i].get("eval/loss") for i in a)
  assert all(_summary(cfgs[0])[k] == _summary(full[0])[k] for k in ("steps", "stopped_early", "eval"))


def test_a_cell_with_a_non_finite_step_stops_without_a_summary_and_stays_stopped(tmp_path, monkeypatch):
  load_task = stacked.load_task

  def poisoned(cfg, *args, **kwargs):  # the second cell's batches 2 and 4 (steps 3 and 5) get NaN weights
    task = load_task(cfg, *args, **kwargs)
    if cfg.seed != 1:
      return task
    nan = lambda i, batch: {**batch, "weights": batch["weights"] * np.nan} if i in (2, 4) else batch
    return dataclasses.replace(task, train=task.train.map_with_index(nan))

  monkeypatch.setattr(stacked, "load_task", poisoned)
  cfgs = [_cfg(tmp_path, s, 3e-3, "train.skip_nonfinite=1") for s in (0, 1)]
  lines = []
  summaries = stacked.train_stacked(cfgs, log=lines.append)
  text = "\n".join(lines)
  assert "s1_lr0.003: step 3: loss nan, gradient norm nan: not finite, update skipped (1 of" in text
  assert "s1_lr0.003: step 5: loss nan, gradient norm nan: not finite, stopped (1 such steps skipped" in text
  assert summaries[0]["steps"] == 16 and summaries[1] is None
  assert not os.path.exists(os.path.join(cfgs[1].run_dir, "summary.json"))
  bad = _records(cfgs[1])
  assert max(bad) == 5 and [s for s, r in sorted(bad.items()) if r.get("train/nonfinite")] == [3, 5]
  # The stop is kept in the group's checkpoint: a relaunch does not train the cell again.
  lines = []
  assert stacked.train_stacked(cfgs, log=lines.append)[1] is None and max(_records(cfgs[1])) == 5


def test_cells_that_differ_in_more_than_seed_and_rate_are_refused(tmp_path):
  a = _cfg(tmp_path, 0, 1e-3)
  b = _cfg(tmp_path, 1, 3e-3, "model.d_model=32", "data.batch_size=8")
  with pytest.raises(ConfigError) as e:
    stacked.train_stacked([a, b], log=QUIET)
  # The keys named are those that may not differ; the seed, the rate, the name and the work directory may.
  assert str(e.value).endswith("'s1_lr0.003' differs from 's0_lr0.001' in config.data.batch_size, "
                               "config.model.d_model")
  with pytest.raises(ConfigError, match="one work directory each"):
    stacked.train_stacked([a, _cfg(tmp_path, 0, 1e-3, "name=other")], log=QUIET)
  assert not os.path.exists(os.path.join(tmp_path, "runs"))  # refused before anything was written


SWEEP = """
import sys
sys.path.insert(0, {root!r})
from configs import quickstart

def get_config():
  c = quickstart.get_config()
  c.name = "stacked_sweep"
  c.sweep.models = {{"attention": ("model.pattern=A",), "gdn": ("model.pattern=R",)}}
  c.sweep.learning_rates = (1e-3, 3e-3, 1e-2)
  return c
"""


def test_compare_stack_trains_every_cell_and_writes_the_report(tmp_path, monkeypatch, capsys):
  path = str(tmp_path / "sweep.py")
  with open(path, "w") as f:
    f.write(SWEEP.format(root=ROOT))
  monkeypatch.chdir(tmp_path)
  overrides = [o for o in TINY if not o.startswith(("model.pattern", "model.num_layers", "train.stop_step"))]
  overrides += ["model.num_layers=1", "train.steps=8", "train.eval_every=0", "train.checkpoint_every=0"]
  args = ["--config", path, *(f"--config.{o}" for o in overrides)]
  cells = grid.expand(apply_overrides(load(path), overrides))
  # At most 2 cells a program, within each model: 2 + 1 for each of the two models.
  assert [len(p) for p in grid.stacks(cells, 2)] == [2, 1, 2, 1]
  assert compare.main([*args, "--stack", "--stack-size", "2"]) == 0
  assert "] stacked: attention__base__seed0__lr0.001, attention__base__seed0__lr0.003" in capsys.readouterr().out
  assert len(cells) == 6 and all(grid.done(c) for c in cells)
  assert grid.stacks(cells, 2) == []  # nothing left to train
  assert len(os.listdir(os.path.join("results", "stacked_sweep", "runs", ".stacked"))) == 4
  with open(os.path.join("results", "stacked_sweep", "table.md")) as f:
    table = f.read()
  assert "| attention | base |" in table and "| gdn | base |" in table

  assert compare.main([*args, "--stack", "--stack-size", "2"]) == 0
  assert capsys.readouterr().out.count("done already") == 6
  assert compare.main([*args, "--stack-size", "2"]) == 2  # --stack-size without --stack is refused


def test_pieces_resume_checkpointed_groups_and_leave_finished_cells_out(tmp_path, monkeypatch):
  """`grid.stacks` on a half-done sweep: a cell that finished joins no piece, a piece with checkpoints (found by
  its cells.json) comes back as it was, and the rest of its group fills new pieces."""
  path = str(tmp_path / "sweep.py")
  with open(path, "w") as f:
    f.write(SWEEP.format(root=ROOT))
  monkeypatch.chdir(tmp_path)
  cells = grid.expand(load(path))  # attention, then gdn, each at 1e-3, 3e-3, 1e-2
  os.makedirs(cells[0].config.run_dir)
  with open(os.path.join(cells[0].config.run_dir, "summary.json"), "w") as f:
    json.dump({"steps": cells[0].config.train.last_step}, f)
  piece = os.path.join("results", "stacked_sweep", "runs", ".stacked", "0123456789abcdef")
  os.makedirs(os.path.join(piece, "checkpoints", "4"))
  with open(os.path.join(piece, "cells.json"), "w") as f:
    json.dump([cells[5].id, cells[4].id], f)
  ids = lambda pieces: [[c.id for c in p] for p in pieces]
  assert ids(grid.stacks(cells, 2)) == [[cells[1].id, cells[2].id], [cells[5].id, cells[4].id], [cells[3].id]]
  assert ids(grid.stacks(cells)) == [[cells[1].id, cells[2].id], [cells[5].id, cells[4].id], [cells[3].id]]
  os.rmdir(os.path.join(piece, "checkpoints", "4"))  # without checkpoints the piece is not kept
  assert ids(grid.stacks(cells, 2)) == [[cells[1].id, cells[2].id], [cells[3].id, cells[4].id], [cells[5].id]]


def test_matmul_precision_is_set_around_training_alone_and_stacked(tmp_path, monkeypatch):
  """train.matmul_precision is the `jax.default_matmul_precision` that `train` and `train_stacked` run their
  work in ("" leaves it alone); a value JAX does not name is refused with the key."""
  import jax

  from gdn.train import loop

  seen = []
  record = lambda *a, **k: seen.append(jax.config.jax_default_matmul_precision) or []
  monkeypatch.setattr(loop, "_train", record)
  monkeypatch.setattr(stacked, "_train_stacked", record)
  before = jax.config.jax_default_matmul_precision
  train(_cfg(tmp_path, 0, 1e-3, "train.matmul_precision=float32"), log=QUIET)
  stacked.train_stacked([_cfg(tmp_path / "st", s, 1e-3, "train.matmul_precision=bfloat16") for s in (0, 1)],
                        log=QUIET)
  train(_cfg(tmp_path / "plain", 0, 1e-3), log=QUIET)
  assert seen == ["float32", "bfloat16", before] and jax.config.jax_default_matmul_precision == before
  with pytest.raises(ConfigError, match="matmul_precision"):
    _cfg(tmp_path, 0, 1e-3, "train.matmul_precision=fp32")
