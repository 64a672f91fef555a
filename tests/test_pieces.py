"""`experiments.pieces`: a sweep run as budgeted jobs, each a stacked `gdn-compare` process. The plan takes
every group's seed 0 before any seed 1 and drops what has finished; the jobs train their cells, log their last
evaluations and pack the records; a job that the budget cannot hold is not started, and one that runs out of
time is stopped and logged as cut."""

import json
import os
import re
import tarfile

import pytest

from experiments import pieces
from gdn.sweep import done, expand
from gdn.train import ConfigError
from gdn.train.config_file import apply_overrides, load
from tests.test_stacked import ROOT, SWEEP, TINY

# Two models (attention, gdn) x the overrides' seeds x two rates; 8 steps, no evaluation before the last.
OVERRIDES = [o for o in TINY if not o.startswith(("model.pattern", "model.num_layers", "train.stop_step"))] + [
    "model.num_layers=1", "train.steps=8", "train.eval_every=0", "train.checkpoint_every=0",
    "sweep.learning_rates=(1e-3,3e-3)"]


@pytest.fixture
def sweep(tmp_path, monkeypatch):
  path = str(tmp_path / "sweep.py")
  with open(path, "w") as f:
    f.write(SWEEP.format(root=ROOT))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # the jobs' processes compile as fast_compile does
  return path


def _cells(path, *extra):
  return expand(apply_overrides(load(path), OVERRIDES + list(extra)))


def _finish(cell):
  os.makedirs(cell.config.run_dir)
  with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
    json.dump({"steps": cell.config.train.last_step}, f)


def test_the_plan_goes_seed_by_seed_and_leaves_finished_cells_out(sweep):
  cells = _cells(sweep, "sweep.seeds=(0,1)")  # attention seeds 0, 1, then gdn seeds 0, 1, two rates each
  assert pieces.group_labels(cells) == ["attention", "gdn"]
  assert pieces.plan(cells, ["next"]) == [(0, 0), (1, 0), (0, 1), (1, 1)]
  for c in cells[:2]:  # attention's seed 0
    _finish(c)
  assert pieces.plan(cells, ["next"]) == [(1, 0), (0, 1), (1, 1)]
  assert pieces.plan(cells, ["attention:0", "gdn:all", "1:all", "0:1"]) == [(1, None), (0, 1)]
  _finish(cells[2])  # one of attention's two seed-1 cells: the other keeps the job
  assert pieces.plan(cells, ["0:1"]) == [(0, 1)]
  for bad, says in [("mamba:0", "the groups are 0-1: attention, gdn"), ("gdn:7", "must be one of [0, 1]"),
                    ("gdn", "a job is g:s"), ("2:0", "no group '2'")]:
    with pytest.raises(ConfigError, match=re.escape(says)):
      pieces.plan(cells, [bad])


def test_jobs_train_their_cells_log_the_last_evaluations_and_pack_the_records(sweep, capsys):
  log, archive = "pieces.txt", "records.tgz"
  args = ["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), "--config.sweep.seeds=(0,)"]
  assert pieces.main([*args, "--jobs", "next", "--budget", "900", "--stack-size", "2", "--log", log,
                      "--archive", archive, "--parallel", "2"]) == 0
  out = capsys.readouterr().out
  starts = [i for i, line in enumerate(out.splitlines()) if re.match(r"job \w+:0: .* \(up to \d+ s\)$", line)]
  ends = [i for i, line in enumerate(out.splitlines()) if re.match(r"job \w+:0 rc=0 ", line)]
  assert len(starts) == len(ends) == 2 and max(starts) < min(ends)  # both ran at once
  cells = _cells(sweep, "sweep.seeds=(0,)")
  assert len(cells) == 4 and all(done(c) for c in cells)
  text = open(log).read()
  assert text.count("job attention:0 rc=0 ") == 1 and text.count("job gdn:0 rc=0 ") == 1
  assert "--stack --stack-size 2 --shard 1/2" in text and "--config.sweep.seeds=(0,)" in text
  assert f"--cells {cells[2].id},{cells[3].id}" in text  # each job one program, its cells named
  for c in cells:  # each cell's evaluation at its last step, as the job printed it
    assert f"{c.id}: step 8: " in text
  with tarfile.open(archive) as tar:
    names = tar.getnames()
  assert {f"results/stacked_sweep/records/{c.id}" for c in cells} <= set(names)
  assert "report: results/stacked_sweep/table.md (4 of 4 cells done)" in out
  # Nothing is left, so a second command plans no job and starts no process.
  assert pieces.main([*args, "--budget", "900", "--log", log]) == 0
  assert "0 job(s) with cells left" in capsys.readouterr().out and open(log).read() == text


def test_a_job_the_budget_cannot_hold_is_not_started_and_one_that_runs_out_is_cut(sweep, capsys):
  args = ["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), "--config.sweep.seeds=(0,)", "--jobs", "0:0"]
  assert pieces.main([*args, "--budget", "40", "--reserve", "30", "--min-left", "20"]) == 0
  assert "job attention:0: not started, 10 s left (--min-left 20)" in capsys.readouterr().out
  assert not os.path.exists(os.path.join("results", "stacked_sweep", "runs", _cells(sweep)[0].id))
  # 2 s: the job's process is stopped before it can train a step; the cut is logged, not raised.
  assert pieces.main([*args, "--budget", "32", "--reserve", "30", "--log", "pieces.txt"]) == 0
  out = capsys.readouterr().out
  assert "job attention:0 rc=124 " in out and "report: none" in out
  assert "rc=124" in open("pieces.txt").read()
  assert not any(done(c) for c in _cells(sweep, "sweep.seeds=(0,)"))


def test_bad_arguments_are_refused_with_the_reason(sweep, capsys):
  assert pieces.main(["--budget", "10"]) == 2
  assert "--config is required" in capsys.readouterr().err
  assert pieces.main(["--config", sweep, "--budget", "10", "--jobs", "0:x"]) == 2
  assert "the seed must be one of" in capsys.readouterr().err
  assert pieces.main(["--config", sweep, "--budget", "10", "--stack-size", "-1"]) == 2
  assert "--stack-size must be >= 0" in capsys.readouterr().err
  assert pieces.main(["--config", sweep, "--budget", "10", "--parallel", "0"]) == 2
  assert "--parallel must be >= 1" in capsys.readouterr().err


def test_with_tuning_seeds_the_others_wait_for_their_rate_and_then_run_as_one_job_a_group(sweep):
  """sweep.tune_seeds=(0,): seed 0 runs both rates; seeds 1 and 2 of a group appear once its seed 0 has
  finished, at the rate with the better final metric only, and "next" gives them one job (every seed) after
  the tuning seeds' jobs."""
  extra = ("sweep.seeds=(0,1,2)", "sweep.tune_seeds=(0,)")
  cells = _cells(sweep, *extra)
  assert [(c.model, c.seed, c.lr) for c in cells] == [(m, 0, lr) for m in ("attention", "gdn") for lr in (1e-3, 3e-3)]
  assert pieces.plan(cells, ["next"]) == [(0, 0), (1, 0)]
  metric, sign = cells[0].config.sweep.metric, 1 if cells[0].config.sweep.mode == "min" else -1
  for c in cells[:2]:  # attention's seed 0: 3e-3 the better rate
    _finish(c)
    with open(os.path.join(c.config.run_dir, "summary.json"), "w") as f:
      json.dump({"steps": c.config.train.last_step, "eval": {metric: sign * (1.0 if c.lr == 1e-3 else 0.5)}}, f)
  cells = _cells(sweep, *extra)
  assert [(c.model, c.seed, c.lr) for c in cells if c.model == "attention"] == [
      ("attention", 0, 1e-3), ("attention", 0, 3e-3), ("attention", 1, 3e-3), ("attention", 2, 3e-3)]
  assert [(c.seed, c.lr) for c in cells if c.model == "gdn"] == [(0, 1e-3), (0, 3e-3)]
  assert pieces.plan(cells, ["next"]) == [(1, 0), (0, None)]
  cmd = pieces.job_command(sweep, list(extra), 0, 2, None, 3)
  # every seed: no seed override of the job's own beside the sweep's
  assert [part for part in cmd if part.startswith("--config.sweep.seeds=")] == ["--config.sweep.seeds=(0,1,2)"]
  # a job for seed 1 alone (its seeds overridden) still finds the rate that seed 0 picked
  only_1 = _cells(sweep, "sweep.seeds=(1,)", "sweep.tune_seeds=(0,)")
  assert [(c.model, c.seed, c.lr) for c in only_1] == [("attention", 1, 3e-3)]
  # one rate: nothing to tune, every seed listed at once
  one_rate = _cells(sweep, "sweep.seeds=(0,1)", "sweep.tune_seeds=(0,)", "sweep.learning_rates=(1e-3,)")
  assert [(c.model, c.seed) for c in one_rate] == [("attention", 0), ("attention", 1), ("gdn", 0), ("gdn", 1)]


def test_each_program_is_a_job_and_one_the_time_left_cannot_hold_is_not_started(sweep, capsys):
  """A job's cells become one job per stacked program (`--cells`); a program is estimated by the longest
  finished program of its group (else of the sweep) and not started where the time left is under --fit times
  that, while a shorter one behind it may still start."""
  cells = _cells(sweep, "sweep.seeds=(0,)")  # attention at two rates, then gdn at two rates
  ids = [(c.id,) for c in cells]
  assert pieces.programs(cells, pieces.plan(cells, ["next"]), 1) == [(0, 0, ids[0]), (0, 0, ids[1]),
                                                                    (1, 0, ids[2]), (1, 0, ids[3])]
  assert pieces.programs(cells, pieces.plan(cells, ["next"]), 0) == [(0, 0, ids[0] + ids[1]),
                                                                    (1, 0, ids[2] + ids[3])]
  assert pieces.estimate(cells, 0) is None
  for cell, seconds in ((cells[0], 500.0), (cells[2], 5.0)):
    _finish(cell)
    with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
      json.dump({"steps": cell.config.train.last_step, "seconds": seconds}, f)
  assert pieces.estimate(cells, 0) == 500.0 and pieces.estimate(cells, 1) == 5.0
  assert pieces.programs(cells, [(0, 0)], 1) == [(0, 0, ids[1])]  # finished cells leave their programs
  cmd = pieces.job_command(sweep, OVERRIDES, 0, 2, 0, 1, ids[1])
  assert cmd[-2:] == ["--cells", cells[1].id] and "--shard" in cmd
  args = ["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), "--config.sweep.seeds=(0,)"]
  assert pieces.main([*args, "--jobs", "0:0", "--budget", "130", "--reserve", "30", "--stack-size", "1"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"job attention:0: not started, \d+ s left, about 500 s needed \(--fit 1.1 x", out)
  assert not os.path.exists(cells[1].config.run_dir)
  assert pieces.main([*args, "--jobs", "0:0", "--budget", "10", "--fit", "-1"]) == 2
  assert "--fit must be >= 0" in capsys.readouterr().err


def test_a_program_that_finished_in_the_same_command_sets_the_estimate(sweep, capsys, monkeypatch):
  """The estimate is taken as each program is about to start: the first program of a sweep with nothing finished
  starts unestimated, and once it has finished (500 s, as its summary says) the next one is not started in the
  100 s left. (The programs here write their summaries without training: `start_job` is a stand-in.)"""
  cells = _cells(sweep, "sweep.seeds=(0,)")

  class Finished:
    def poll(self):
      return 0

  def start_job(cmd, log_path, env=None):
    ids = cmd[cmd.index("--cells") + 1].split(",")
    for cell in cells:
      if cell.id in ids:
        _finish(cell)
        with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
          json.dump({"steps": cell.config.train.last_step, "seconds": 500.0}, f)
    open(log_path, "w").close()
    return Finished()

  monkeypatch.setattr(pieces, "start_job", start_job)
  args = ["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), "--config.sweep.seeds=(0,)"]
  assert pieces.main([*args, "--jobs", "0:0", "--budget", "130", "--reserve", "30", "--stack-size", "1"]) == 0
  out = capsys.readouterr().out
  assert "job attention:0 [1/2] rc=0 " in out
  assert re.search(r"job attention:0 \[2/2\]: not started, \d+ s left, about 500 s needed", out), out
  assert done(cells[0]) and not os.path.exists(cells[1].config.run_dir)


def test_a_program_that_would_share_the_devices_waits_unless_the_time_left_holds_both(sweep, capsys, monkeypatch):
  """With --parallel 2 a second program starts beside a running one only where the time left holds twice the
  larger of their estimates (each at about half its speed alone); else it waits for the first to end and then
  starts alone. (The estimate, 50 s, is the sweep's: a gdn cell finished before; `start_job` is a stand-in whose
  program ends after a few polls.)"""
  assert pieces.shared_need(50.0, []) == 50.0
  assert pieces.shared_need(50.0, [80.0, None]) == 240.0

  def run(seed, budget):
    cells = _cells(sweep, f"sweep.seeds=({seed},)")
    _finish(cells[2])
    with open(os.path.join(cells[2].config.run_dir, "summary.json"), "w") as f:
      json.dump({"steps": cells[2].config.train.last_step, "seconds": 50.0}, f)

    class Program:
      def __init__(self, ids):
        self.ids, self.polls = ids, 0

      def poll(self):
        self.polls += 1
        if self.polls < 3:
          return None
        for cell in cells:
          if cell.id in self.ids and not os.path.exists(cell.config.run_dir):
            _finish(cell)
        return 0

    def start_job(cmd, log_path, env=None):
      open(log_path, "w").close()
      return Program(cmd[cmd.index("--cells") + 1].split(","))

    monkeypatch.setattr(pieces, "start_job", start_job)
    assert pieces.main(["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), f"--config.sweep.seeds=({seed},)",
                        "--jobs", f"0:{seed}", "--stack-size", "1", "--parallel", "2", "--reserve", "30",
                        "--budget", str(budget)]) == 0
    assert done(cells[0]) and done(cells[1])
    out = capsys.readouterr().out
    return out, out.index(f"job attention:{seed} [1/2] rc=0"), out.index(f"job attention:{seed} [2/2]: python")

  out, first_ends, second_starts = run(0, 130)  # 100 s left: 55 s alone fits, 110 s beside the first does not
  assert re.search(r"job attention:0 \[2/2\]: waits, \d+ s left, about 100 s needed beside 1 running", out), out
  assert first_ends < second_starts
  out, first_ends, second_starts = run(1, 250)  # 220 s left: both start at once
  assert "waits" not in out and second_starts < first_ends, out


def test_compare_refuses_cells_the_sweep_does_not_have(sweep, capsys):
  """(The jobs above train through `gdn-compare --cells`, one program each.)"""
  from experiments import compare
  args = ["--config", sweep, *(f"--config.{o}" for o in OVERRIDES), "--config.sweep.seeds=(0,)"]
  assert compare.main([*args, "--cells", f"{_cells(sweep)[0].id},nope"]) == 2
  assert "--cells: no cell 'nope' in this sweep" in capsys.readouterr().err
