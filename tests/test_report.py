"""gdn-compare's report from run directories (written here by hand, no training): the best learning rate per
cell, the table, the metric at every evaluation, and the plots."""

import json
import os

from gdn.sweep import expand, write_report
from gdn.train.config_file import apply_overrides, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_run(cell, history):
  """A finished run whose validation bits per byte were `history` {step: value}; the last is the final one."""
  os.makedirs(cell.config.run_dir)
  final = history[max(history)]
  with open(os.path.join(cell.config.run_dir, "summary.json"), "w") as f:
    json.dump({"steps": max(history), "params": 1000, "eval": {"val/bits_per_byte": final,
                                                              "bits_per_byte": final}}, f)
  with open(os.path.join(cell.config.run_dir, "metrics.jsonl"), "w") as f:
    for step, value in sorted(history.items()):
      f.write(json.dumps({"step": step, "train/loss": 2.0 - step / 1000}) + "\n")
      f.write(json.dumps({"step": step, "eval/val/bits_per_byte": value, "eval/bits_per_byte": value}) + "\n")


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
  assert "| attention | 1.400 |" in table and "| gdn | 1.200 |" in table and "| hybrid_7to1 | – |" in table
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
  assert f"{cells[0].id} stopped, left out of the report: step 7" in "\n".join(lines)
