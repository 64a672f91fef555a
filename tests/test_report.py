"""gdn-compare's report from run directories (written here by hand, no training): the best learning rate per
cell, the table, the metric at every evaluation, and the plots."""

import json
import os

import numpy as np
import pytest

from gdn.sweep import expand, write_report
from gdn.train.config_file import apply_overrides, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_run(cell, history, metric="bits_per_byte", split="val", stopped_early=False):
  """A finished run whose eval `metric` (one split) was `history` {step: value}; the last is the final one."""
  os.makedirs(cell.config.run_dir)
  final = history[max(history)]
  with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
    json.dump({"steps": max(history), "params": 1000, "stopped_early": stopped_early,
               "eval": {f"{split}/{metric}": final, metric: final}}, f)
  with open(os.path.join(cell.config.run_dir, "metrics.jsonl"), "w") as f:
    for step, value in sorted(history.items()):
      f.write(json.dumps({"step": step, "train/loss": 2.0 - step / 1000}) + "\n")
      f.write(json.dumps({"step": step, f"eval/{split}/{metric}": value, f"eval/{metric}": value}) + "\n")


def _finished(cell, steps: int, ev: dict):
  """A finished run with one evaluation, at its last step: `ev` {split/metric or metric: value}."""
  os.makedirs(cell.config.run_dir)
  with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
    json.dump({"steps": steps, "params": 1000, "eval": ev}, f)
  with open(os.path.join(cell.config.run_dir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": steps, "train/loss": 0.5, **{f"eval/{k}": v for k, v in ev.items()}}) + "\n")


def test_report_picks_the_best_rate_and_shows_every_evaluation(tmp_path):
  config = apply_overrides(load(os.path.join(ROOT, "configs", "hybrid.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)",))
  cells = expand(config, results=str(tmp_path))
  for cell in cells:
    lr_penalty = 0.0 if cell.lr == 3e-3 else 0.5  # the larger rate is better for every model
    if cell.model == "attention":  # overfits: best at step 100, worse at the end
      _fake_run(cell, {100: 1.0 + lr_penalty, 200: 1.4 + lr_penalty})
    elif cell.model != "hybrid_7to1":  # one model left unfinished: its row reads "–"
      _fake_run(cell, {100: 1.3 + lr_penalty, 200: 1.2 + lr_penalty})
  paths = write_report(cells, str(tmp_path), title="t")
  table = open(paths["table.md"]).read()
  assert "| attention | 1.400 (lr 3e-03) |" in table and "| gdn | 1.200 (lr 3e-03) |" in table
  assert "| hybrid_7to1 | – |" in table and "Chance" not in table
  assert "| attention | base | 1.000 | 1.400 |" in table
  assert "| model | setting | step 100 | step 200 |" in table
  assert "| attention | base | 1.000 | 1.400 |" in table and "| gdn | base | 1.300 | 1.200 |" in table
  best = open(paths["best.csv"]).read().splitlines()
  assert len(best) == 1 + 4 and all(",0.003," in line for line in best[1:])
  for name in ("loss_curves.png", "eval_curves.png"):
    assert os.path.getsize(paths[name]) > 1000


def test_a_cell_stopped_by_a_non_finite_step_does_not_end_the_sweep(tmp_path, monkeypatch):
  from gdn.sweep import grid
  from gdn.train import NonFiniteLoss

  config = apply_overrides(load(os.path.join(ROOT, "configs", "hybrid.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)",))
  cells = expand(config, results=str(tmp_path))[:3]
  trained = []

  def train(cfg, log):
    trained.append(cfg.name)
    if len(trained) == 1:
      raise NonFiniteLoss("step 7: loss nan, gradient norm nan: not finite, stopped")

  monkeypatch.setattr(grid, "train", train)
  lines = []
  grid.run_cells(cells, log=lines.append)
  assert trained == [c.id for c in cells]
  assert f"{cells[0].id} stopped, left out of the report's means: step 7" in "\n".join(lines)
  # marked: done for the sweep (not trained again), and the reason kept
  from gdn.sweep import done, records
  assert done(cells[0]) and not done(cells[1])
  assert records.nonfinite(cells[0].config).startswith("step 7: loss nan")
  trained.clear()
  grid.run_cells(cells, log=lines.append)
  assert trained == [c.id for c in cells[1:]]


def test_a_stacked_cell_stopped_by_non_finite_steps_is_marked_and_not_trained_again(tmp_path, monkeypatch):
  from gdn.sweep import done, grid, records

  config = apply_overrides(load(os.path.join(ROOT, "configs", "hybrid.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)",))
  cells = expand(config, results=str(tmp_path))[:2]  # one group's two rates
  calls = []

  def train_stacked(cfgs, log):
    calls.append([c.name for c in cfgs])
    return [{"steps": 1}, None]

  monkeypatch.setattr(grid, "train_stacked", train_stacked)
  lines = []
  grid.run_cells(cells, stack=True, log=lines.append)
  assert calls == [[c.id for c in cells]]
  assert f"{cells[1].id} stopped by non-finite steps" in "\n".join(lines)
  assert done(cells[1]) and "stacked program" in records.nonfinite(cells[1].config)
  assert grid.stacks(cells) == [[cells[0]]]  # the stopped cell joins no new piece


def test_report_shows_mean_and_std_over_seeds_the_rates_picked_and_every_rate(tmp_path):
  config = apply_overrides(load(os.path.join(ROOT, "configs", "mqar.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)", "train.early_stop=0.75"))
  assert config.sweep.seeds == (0, 1, 2)
  cells = expand(config, results=str(tmp_path))
  for cell in cells:
    if cell.model not in ("attention", "deltanet"):
      continue
    # deltanet: 0.9 / 0.8 / 0.7 by seed at 1e-3, 0.5 at 3e-3; attention: 3e-3 wins for seeds 0 and 1 only
    if cell.model == "deltanet":
      final = 0.9 - 0.1 * cell.seed if cell.lr == 1e-3 else 0.5
    else:
      final = {(0, 3e-3): 0.6, (1, 3e-3): 0.4, (2, 1e-3): 0.2}.get((cell.seed, cell.lr), 0.1)
    if final >= 0.75:  # stopped at its first evaluation that reached 0.75 (seeds 0 and 1 of deltanet at 1e-3)
      _fake_run(cell, {100 * (1 + cell.seed): final}, metric="accuracy", split="T64_P4", stopped_early=True)
    else:
      _fake_run(cell, {150: final / 2, 300: final}, metric="accuracy", split="T64_P4")
  paths = write_report(cells, str(tmp_path), title="t")
  table = open(paths["table.md"]).read()
  assert "Chance: 0.007812. Runs finished: 12 of 24." in table  # 2 / 256: one of the 128 values
  assert "| deltanet | 150 ± 50 (2/3) |" in table and "| attention | never (0/3) |" in table
  assert "| deltanet | 0.800 ± 0.082 (lr 1e-03 ×3) |" in table
  assert "| attention | 0.400 ± 0.163 (lr 1e-03, 3e-03 ×2) |" in table
  assert "| deltanet | d64 | 0.800 ± 0.082 | 0.500 ± 0.000 |" in table  # every rate, not only the best
  assert "| attention | d64 | 0.100 ± 0.000 |" not in table
  assert "| attention | d64 | 0.133 ± 0.047 | 0.367 ± 0.205 |" in table
  assert "| gated_deltanet | – |" in table
  for name in ("metric_vs_x.png", "loss_curves.png", "eval_curves.png"):
    assert os.path.getsize(paths[name]) > 1000


def test_state_tracking_report_plots_the_metric_against_the_eval_length(tmp_path):
  config = apply_overrides(load(os.path.join(ROOT, "configs", "state_tracking.py") + ":small"),
                           ("sweep.seeds=(0,1,2)", "sweep.learning_rates=(1e-3,3e-3)"))
  cells = expand(config, results=str(tmp_path))
  for cell in cells:
    solved = 1.0 if cell.model.endswith("beta02") else 0.0
    # beta02: seeds 0, 1, 2 lose 0, 0.1, 0.2 beyond 64 at 3e-3; at 1e-3 seed 2 is best but the median worse
    drop = 0.1 * cell.seed if cell.lr == 3e-3 else (0.6, 0.5, 0.0)[cell.seed]
    ev = {f"T{T}/scaled_accuracy": solved - drop * (T > 64) for T in (40, 64, 128, 256)}
    ev["scaled_accuracy"] = sum(ev.values()) / 4
    _finished(cell, 600, ev)
  paths = write_report(cells, str(tmp_path), title="t")
  table = open(paths["table.md"]).read()
  assert "Chance: 0." in table  # scaled accuracy: guessing scores 0
  # each seed's best rate: seed 2 takes 1e-3 (1.0), seeds 0 and 1 take 3e-3 (1.0, 0.95 on the long lengths)
  assert "| deltanet_beta02 | parity | 1.000 ± 0.000 | 1.000 ± 0.000 | 0.967 ± 0.047 | 0.967 ± 0.047 |" in table
  # one rate by the median (3e-3: 0.95 against 0.75 for 1e-3): best seed 1.0, median 0.95 ± 0.05
  assert "| deltanet_beta02 | 1.000; 0.950 ± 0.050 (lr 3e-03, 3 seeds) |" in table
  assert os.path.getsize(paths["scaled_accuracy_vs_length.png"]) > 1000


def test_records_keep_the_report_after_the_runs_are_gone_and_finish_their_cells(tmp_path, monkeypatch):
  """The report writes each finished run's record (results/<name>/records/<cell id>: summary, config, the metrics
  with the training records thinned); with the run directories deleted, the same report comes back from the
  records alone, and a sweep continued there trains only the cells without one."""
  import shutil

  from gdn.sweep import grid, records

  monkeypatch.setattr(records, "MAX_TRAIN_POINTS", 10)
  config = apply_overrides(load(os.path.join(ROOT, "configs", "hybrid.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)",))
  cells = expand(config, results=str(tmp_path))
  unfinished = cells[-1]
  for i, cell in enumerate(cells[:-1]):
    _fake_run(cell, {100 * s: 1.5 - 0.01 * s - 0.1 * i for s in range(1, 51)}, stopped_early=True)
  paths = write_report(cells, str(tmp_path), title="t")
  first = {name: open(paths[name]).read() for name in ("table.md", "results.csv", "best.csv")}
  rec = records.record_dir(cells[0].config.run_dir)
  assert rec == os.path.join(str(tmp_path), "records", cells[0].id)
  assert sorted(os.listdir(rec)) == ["metrics.jsonl", "summary.json"]  # the fake runs wrote no config.json
  kept = [json.loads(line) for line in open(os.path.join(rec, "metrics.jsonl"))]
  assert sum("train/loss" in r for r in kept) == 10 and sum("eval/val/bits_per_byte" in r for r in kept) == 50
  assert kept[-2]["step"] == 5000  # the last training record is kept
  assert f",{rec}," in first["results.csv"]  # rows point at the records, which are committed

  shutil.rmtree(os.path.join(str(tmp_path), "runs"))
  paths = write_report(cells, str(tmp_path), title="t")
  assert {name: open(paths[name]).read() for name in first} == first
  # An unfinished run of a cell whose record is finished (run elsewhere) leaves the record as it was.
  _fake_run(cells[0], {100: 9.0})
  paths = write_report(cells, str(tmp_path), title="t")
  assert {name: open(paths[name]).read() for name in first} == first
  shutil.rmtree(cells[0].config.run_dir)
  trained = []
  monkeypatch.setattr(grid, "train", lambda cfg, log: trained.append(cfg.name))
  grid.run_cells(cells, log=lambda *_: None)
  assert trained == [unfinished.id]


def test_records_imported_from_an_earlier_results_csv(tmp_path, monkeypatch):
  """`records.import_csv`: a report whose runs and records are gone comes back from its results.csv with the same
  final numbers, schedule and rates picked, says which runs have no history, and their cells count as finished."""
  import shutil

  from gdn.sweep import grid, records

  config = apply_overrides(load(os.path.join(ROOT, "configs", "mqar.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,3e-3)", "train.early_stop=0.75", "train.stop_step=300"))
  cells = [c for c in expand(config, results=str(tmp_path)) if c.model == "deltanet"]
  for cell in cells:
    _fake_run(cell, {150: 0.3, 300: 0.6 - 0.1 * cell.seed + (cell.lr == 3e-3) * 0.2}, metric="accuracy",
              split="T64_P4")
    with open(os.path.join(cell.config.run_dir, "config.json"), "w") as f:
      json.dump({"train": {"steps": cell.config.train.steps, "stop_step": 300}}, f)
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  for d in ("runs", "records"):
    shutil.rmtree(os.path.join(str(tmp_path), d))
  assert len(records.import_csv(str(tmp_path))) == len(cells)
  assert records.import_csv(str(tmp_path)) == []  # once
  again = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert f"{len(cells)} of them have no metrics history" in again
  lines = table.splitlines()
  cut = next(i for i, line in enumerate(lines) if "at each evaluation" in line)
  assert "at each evaluation" not in again
  assert cut > 10
  for line in lines[3:cut]:  # every final number, rate, budget and split (the header's run count changed)
    assert line in again.splitlines(), line
  assert "| budget |" in again and f"300 of {cells[0].config.train.steps}" in again
  trained = []
  monkeypatch.setattr(grid, "train", lambda cfg, log: trained.append(cfg.name))
  grid.run_cells(cells, log=lambda *_: None)
  assert trained == []


def test_compare_import_csv(tmp_path, monkeypatch, capsys):
  """`gdn-compare --import-csv` writes the records of the sweep's results.csv and exits; without one it says so."""
  import shutil

  from experiments import compare

  monkeypatch.chdir(tmp_path)
  spec = os.path.join(ROOT, "configs", "hybrid.py") + ":small"
  cells = expand(load(spec))
  for cell in cells[:2]:
    _fake_run(cell, {100: 1.2, 200: 1.1})
  out_dir = os.path.join("results", load(spec).name)
  write_report(cells, out_dir)
  for d in ("runs", "records"):
    shutil.rmtree(os.path.join(out_dir, d))
  assert compare.main(["--config", spec, "--import-csv"]) == 0
  assert "2 records written to" in capsys.readouterr().out
  assert sorted(os.listdir(os.path.join(out_dir, "records"))) == sorted(c.id for c in cells[:2])
  assert compare.main(["--config", spec, "--config.name=other", "--import-csv"]) == 2
  assert "no results/other/results.csv" in capsys.readouterr().err


def test_report_names_the_cells_that_picked_an_end_of_the_rate_grid(tmp_path):
  """With three or more rates, a (model, setting) whose seeds' best rate is the grid's lowest or highest is
  named (its best rate may lie outside the grid); one that picked inside it is not, nor any with two rates."""
  config = apply_overrides(load(os.path.join(ROOT, "configs", "mqar.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,2e-3,4e-3)",))
  cells = expand(config, results=str(tmp_path))
  best = {"deltanet": {0: 1e-3, 1: 1e-3, 2: 2e-3}, "attention": {0: 4e-3, 1: 4e-3, 2: 4e-3},
          "gated_deltanet": {0: 2e-3, 1: 2e-3, 2: 2e-3}}
  for cell in cells:
    if cell.model in best:
      final = 0.9 if cell.lr == best[cell.model][cell.seed] else 0.5
      _fake_run(cell, {300: final}, metric="accuracy", split="T64_P4")
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert ("Picked at an end of the rate grid, so the best rate may lie outside it (a grid widened for every model "
          "would tell): attention: 3 of 3 seeds at the highest (4e-03); deltanet: 2 of 3 seeds at the lowest "
          "(1e-03).") in table
  assert "gated_deltanet:" not in table


def test_with_tuning_seeds_every_seed_is_reported_at_the_rate_the_tuning_seeds_picked(tmp_path):
  """sweep.tune_seeds=(0,): the report takes seeds 0-2 at the rate seed 0 did best at, though seed 1's own best
  would be another (its other rates are not cells of the sweep), and names a model whose seed 0 is still
  missing a rate as still tuning."""
  config = apply_overrides(load(os.path.join(ROOT, "configs", "mqar.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,2e-3,4e-3)", "sweep.seeds=(0,1,2)", "sweep.tune_seeds=(0,)"))
  seed0 = {1e-3: 0.5, 2e-3: 0.9, 4e-3: 0.7}
  for cell in expand(config, results=str(tmp_path)):
    if cell.model == "deltanet" or (cell.model == "attention" and cell.lr < 4e-3):
      _fake_run(cell, {cell.config.train.last_step: seed0[cell.lr]}, metric="accuracy", split="T64_P4")
  cells = expand(config, results=str(tmp_path))
  assert sorted((c.seed, c.lr) for c in cells if c.model == "deltanet" and c.seed > 0) == [(1, 2e-3), (2, 2e-3)]
  assert not any(c.model == "attention" and c.seed > 0 for c in cells)  # its 4e-3 unfinished: no rate yet
  for cell in cells:
    if cell.model == "deltanet" and cell.seed > 0:
      _fake_run(cell, {cell.config.train.last_step: 0.8 + 0.02 * cell.seed}, metric="accuracy", split="T64_P4")
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert "every seed at the rate whose mean over seed 0 is best, from [0.001, 0.002, 0.004]" in table
  assert "| deltanet | 0.853 ± 0.034 (lr 2e-03 ×3) |" in table
  assert "| attention | 0.900 (lr 2e-03) |" in table
  assert "Still tuning (seed 0 has not finished every rate, so the rate may change): attention." in table
  assert "median over seeds is best" not in table
  # attention's 4e-3 stopped by non-finite steps: a result, its rate loses, the tuning is complete
  from gdn.sweep import records
  stopped = next(c for c in cells if c.model == "attention" and c.lr == 4e-3)
  records.mark_nonfinite(stopped.config.run_dir, "step 9: loss nan, gradient norm nan: not finite, stopped")
  cells = expand(config, results=str(tmp_path))
  assert sorted((c.seed, c.lr) for c in cells if c.model == "attention" and c.seed > 0) == [(1, 2e-3), (2, 2e-3)]
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert f"Stopped by non-finite steps, so without a result (their rate lost): {stopped.id}." in table
  assert "Still tuning" not in table
  assert os.path.exists(os.path.join(tmp_path, "records", stopped.id, records.NONFINITE))


def test_extend_edges_widens_a_groups_grid_where_its_tuning_seed_is_best_at_an_end(tmp_path):
  """sweep.extend_edges=2: a model whose seed 0 is best at the grid's top (deltanet) gets the next rate at the
  grid's ratio (8e-3), then, best there too, one more (1.6e-2), and no third; one best at the bottom
  (attention) gets 5e-4 and, once an interior rate wins, no more. Seeds 1 and 2 wait for the widened tuning;
  the report names each group's added rates and takes its grid, not the union, for "still tuning" and the
  grid's ends."""
  config = apply_overrides(load(os.path.join(ROOT, "configs", "mqar.py") + ":small"),
                           ("sweep.learning_rates=(1e-3,2e-3,4e-3)", "sweep.seeds=(0,1,2)", "sweep.tune_seeds=(0,)",
                            "sweep.extend_edges=2"))
  up = {1e-3: 0.5, 2e-3: 0.6, 4e-3: 0.7, 8e-3: 0.8, 1.6e-2: 0.9}  # deltanet's seed 0: best at the top
  inside = {1e-3: 0.6, 2e-3: 0.8, 4e-3: 0.7}  # the other two recurrent models: best inside
  score = dict(deltanet=up, attention={5e-4: 0.7, 1e-3: 0.8, 2e-3: 0.6, 4e-3: 0.5}, gated_deltanet=inside,
               hybrid_3to1=inside)

  def rates(model):
    return [c.lr for c in expand(config, results=str(tmp_path)) if c.model == model and c.seed == 0]

  def finish_seed0():
    for cell in expand(config, results=str(tmp_path)):
      if cell.seed == 0 and not os.path.exists(os.path.join(cell.config.run_dir, "summary.json")):
        _fake_run(cell, {cell.config.train.last_step: score[cell.model][cell.lr]}, metric="accuracy",
                  split="T64_P4")

  assert rates("deltanet") == rates("attention") == [1e-3, 2e-3, 4e-3]
  finish_seed0()  # deltanet best at 4e-3, attention at 1e-3: each grid grows at that end
  assert rates("deltanet") == [1e-3, 2e-3, 4e-3, 8e-3] and rates("attention") == [5e-4, 1e-3, 2e-3, 4e-3]
  cells = expand(config, results=str(tmp_path))
  others = lambda model: sorted((c.seed, c.lr) for c in cells if c.seed > 0 and c.model == model)
  assert others("deltanet") == others("attention") == [] and others("gated_deltanet") == [(1, 2e-3), (2, 2e-3)]
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert "Still tuning (seed 0 has not finished every rate, so the rate may change): attention, deltanet." in table
  finish_seed0()  # deltanet best at 8e-3: one more; attention's 5e-4 loses to 1e-3, now inside: done
  assert rates("deltanet") == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2] and rates("attention") == [5e-4, 1e-3, 2e-3, 4e-3]
  cells = expand(config, results=str(tmp_path))
  assert others("attention") == [(1, 1e-3), (2, 1e-3)] and others("deltanet") == []
  finish_seed0()  # 1.6e-2 best again, but two rates at most
  assert rates("deltanet") == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
  cells = expand(config, results=str(tmp_path))
  assert others("deltanet") == [(1, 1.6e-2), (2, 1.6e-2)]
  table = open(write_report(cells, str(tmp_path), title="t")["table.md"]).read()
  assert ("widened beyond an end where that end was best (sweep.extend_edges=2: attention [0.0005]; deltanet "
          "[0.008, 0.016])") in table
  assert "Still tuning" not in table
  edges = table.split("Picked at an end of the rate grid")[1].split("\n\n")[0]
  assert "deltanet: 1 of 1 seed at the highest (2e-02)" in edges  # its own grid's end, the added rate
  assert "attention" not in edges  # 1e-3: inside its widened grid
  with pytest.raises(ValueError, match="extend_edges needs tune_seeds"):
    expand(apply_overrides(config, ("sweep.tune_seeds=()",)))


def test_a_sweep_refuses_finished_cells_of_another_config_and_names_a_bad_metric_or_x_key(tmp_path, monkeypatch,
                                                                                       capsys):
  from experiments import compare
  from gdn.sweep import grid
  from gdn.train.checkpoint import ConfigMismatch
  from gdn.train.config import ConfigError
  from gdn.train.workdir import write_config

  spec = os.path.join(ROOT, "configs", "hybrid.py") + ":small"
  cells = expand(apply_overrides(load(spec), ("sweep.learning_rates=(1e-3,)",)), results=str(tmp_path))[:2]
  for cell in cells:
    _fake_run(cell, {cell.config.train.last_step: 1.2})
    write_config(cell.config, cell.config.run_dir)
  monkeypatch.setattr(grid, "train", lambda cfg, log: pytest.fail("a finished cell was trained"))
  grid.run_cells(cells, log=lambda *_: None)  # the same config: done already
  changed = expand(apply_overrides(load(spec), ("sweep.learning_rates=(1e-3,)", "train.weight_decay=0.5")),
                   results=str(tmp_path))[:2]
  with pytest.raises(ConfigMismatch, match="train.weight_decay: 0.1 -> 0.5"):
    grid.run_cells(changed, log=lambda *_: None)

  paths = write_report(cells, str(tmp_path), title="t")
  table = open(paths["table.md"]).read()
  typo = expand(apply_overrides(load(spec), ("sweep.learning_rates=(1e-3,)", "sweep.metric=bpb")),
                results=str(tmp_path))[:2]
  with pytest.raises(ValueError, match="sweep.metric 'bpb' is in no finished cell's eval metrics"):
    write_report(typo, str(tmp_path), title="t")
  assert open(paths["table.md"]).read() == table  # not overwritten
  with pytest.raises(ConfigError, match="x_key 'model.d_modle'"):
    expand(apply_overrides(load(spec), ("sweep.x_key=model.d_modle",)), results=str(tmp_path))
  for bad in ("abc", "1", "0/2/3"):
    assert compare.main(["--config", spec, "--shard", bad, "--list"]) == 2
    assert "--shard must be i/n" in capsys.readouterr().err


def test_a_sweep_trains_no_cell_beside_finished_cells_of_another_corpus(tmp_path, monkeypatch):
  """gdn-corpus reads the installation it runs in, so the corpus of a sweep's finished cells can change under
  it (a package installed since): the sweep then refuses to train before any step, and a report whose runs
  met two corpora says that they are not comparable, naming the runs of the other one."""
  from gdn.sweep import grid
  data = tmp_path / "pycode"
  data.mkdir()
  rng = np.random.default_rng(0)
  for name in ("train.bin", "val.bin"):
    (data / name).write_bytes(rng.integers(32, 127, 200_000, dtype=np.uint8).tobytes())

  def build(sha):
    (data / "manifest.json").write_text(json.dumps(
        {"python": "3.12.3", "roots": ["stdlib", "site-packages"], "train": {"sha256": sha, "files": 7}}))

  def finish(cell, sha):
    _fake_run(cell, {150: 1.2})
    path = os.path.join(cell.config.run_dir, "summary.json")
    summary = json.load(open(path))
    json.dump(dict(summary, corpus={"train": {"sha256": sha}}), open(path, "w"))

  spec = os.path.join(ROOT, "configs", "lm_hybrids.py") + ":small"
  config = apply_overrides(load(spec), ("sweep.learning_rates=(1e-3,)", f"data.text.train_file={data}/train.bin",
                                        f"data.text.val_file={data}/val.bin"))
  cells = expand(config, results=str(tmp_path / "results"))[:3]
  for cell in cells[:2]:
    finish(cell, "a" * 64)
  trained = []
  monkeypatch.setattr(grid, "train", lambda cfg, log: trained.append(cfg.run_dir))
  build("b" * 64)
  with pytest.raises(grid.CorpusMismatch, match=r"2 finished cell\(s\) .* \(train.bin SHA-256 bbbbbbbbbbbb, 7 "
                                                r"files, Python 3.12.3.*: " + cells[0].id + " on aaaaaaaaaaaa"):
    grid.run_cells(cells, log=lambda *_: None)
  assert not trained
  build("a" * 64)  # the corpus they were trained on: the third cell trains
  grid.run_cells(cells, log=lambda *_: None)
  assert trained == [cells[2].config.run_dir]

  finish(cells[2], "b" * 64)
  table = open(write_report(cells, str(tmp_path / "results"), title="t")["table.md"]).read()
  assert ("**Not comparable: the runs trained on 2 different corpora** (train.bin SHA-256 aaaaaaaaaaaa: 2 runs; "
          f"bbbbbbbbbbbb: {cells[2].id})") in table


def test_niah_report_plots_each_task_against_the_length_beside_the_papers_numbers(tmp_path):
  from gdn.sweep.report import length_groups  # noqa: PLC0415

  assert length_groups(["T40", "T64"]) == {"": {"T40": 40, "T64": 64}}
  assert length_groups(["sniah1_T64", "sniah1_T128", "sniah2_T64", "sniah2_T128"]) == {
      "sniah1": {"sniah1_T64": 64, "sniah1_T128": 128}, "sniah2": {"sniah2_T64": 64, "sniah2_T128": 128}}
  assert length_groups(["sniah1_T64", "sniah2_T64"]) == {}  # one length a task: nothing to plot against
  assert length_groups(["val", "T64", "T128"]) == {}

  config = load(os.path.join(ROOT, "configs", "niah.py") + ":small")
  config.sweep.models = {m: config.sweep.models[m] for m in ("deltanet", "mamba2")}
  config.sweep.published = {"paper": dict(source="A paper", metric="accuracy (%) / 100", by_split={
      "deltanet": {"sniah1_T64": 0.97, "sniah1_T128": 0.5}, "mamba2": {"sniah2_T512": 0.25}})}
  cells = [c for c in expand(config, results=str(tmp_path)) if c.seed in (0, 1)]
  splits = [f"sniah{t}_T{T}" for t in (1, 2, 3) for T in (64, 128, 256, 512)]
  for cell in cells:
    ev = {f"{sp}/seq_accuracy": (0.9 if cell.model == "deltanet" else 0.3) + 0.1 * cell.seed for sp in splits}
    ev["seq_accuracy"] = float(np.mean(list(ev.values())))
    _finished(cell, 2000, ev)
  paths = write_report(cells, str(tmp_path), title="t")
  table = open(paths["table.md"]).read()
  # only the splits the paper reports, ours (mean ± std over the two seeds) above the paper's row
  assert "| model | sniah1_T64 | sniah1_T128 | sniah2_T512 |" in table
  assert "| deltanet | 0.950 ± 0.050 (2) | 0.950 ± 0.050 (2) | 0.950 ± 0.050 (2) |" in table
  assert "| deltanet (paper) | 0.970 | 0.500 | – |" in table
  assert "| mamba2 (paper) | – | – | 0.250 |" in table
  assert os.path.getsize(paths["seq_accuracy_vs_length.png"]) > 1000


def test_a_published_spec_by_split_is_checked_when_the_config_is_built():
  from gdn.train.config import SweepConfig  # noqa: PLC0415

  with pytest.raises(ValueError, match="by_split needs keys source and metric"):
    SweepConfig(published={"p": dict(source="s", by_split={"deltanet": {"T64": 1.0}})})
  with pytest.raises(ValueError, match="by_split as model"):
    SweepConfig(published={"p": dict(source="s", metric="m", by_split={"deltanet": 1.0})})
