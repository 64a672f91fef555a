"""The cells of a sweep and running them. A cell is the base config plus a model's, a setting's and the sweep's
own "key=value" overrides (in that order), a seed and a learning rate; its run directory is
results/<name>/runs/<cell id>."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os

import ml_collections
import numpy as np

from gdn.data import corpus
from gdn.sweep.records import corpus_digest, finished_record, mark_nonfinite, nonfinite, record_dir
from gdn.train.checkpoint import ConfigMismatch
from gdn.train.config import ConfigError, ExperimentConfig, from_dict
from gdn.train.config_file import apply_overrides
from gdn.train.loop import NonFiniteLoss, train
from gdn.train.stacked import train_stacked
from gdn.train.workdir import as_json, differences, finished, flat, has_checkpoints, saved_config


@dataclasses.dataclass(frozen=True)
class Cell:
  model: str
  setting: str
  seed: int
  lr: float
  config: ExperimentConfig

  @property
  def id(self) -> str:
    return cell_id(self.model, self.setting, self.seed, self.lr)


def cell_id(model: str, setting: str, seed: int, lr: float) -> str:
  """A cell's name: its run directory's and its record's."""
  return f"{model}__{setting}__seed{seed}__lr{lr:g}"


def results_dir(config: ml_collections.ConfigDict) -> str:
  return os.path.join("results", config.name)


def expand(config: ml_collections.ConfigDict, results: str = "") -> list:
  """Every cell of the sweep declared in `config.sweep`, in a fixed order (models, settings, seeds, lrs).

  With `sweep.tune_seeds`, a seed outside them has one cell per (model, setting), at `tuned_rate`, and none
  while that rate is not known yet (a tuning seed's cell unfinished): a later call lists them. With
  `sweep.extend_edges` the tuning seeds' rates of a (model, setting) may go beyond the grid (`tuning_rates`)."""
  results = results or results_dir(config)
  base = from_dict(config.to_dict())
  sweep = base.sweep
  if sweep.x_key and sweep.x_key not in flat(as_json(base)):
    raise ConfigError(f"config.sweep.x_key {sweep.x_key!r} is not a config key (e.g. 'model.d_model')")
  models = sweep.models or {config.name: ()}
  settings = sweep.settings or {"base": ()}
  lrs = sweep.learning_rates or (config.train.learning_rate,)
  tuning = tuning_seeds(sweep)

  def make(model, setting, overrides, seed, lr):
    c = copy.deepcopy(config)
    apply_overrides(c, overrides)
    cell = Cell(model, setting, int(seed), float(lr), None)
    c.seed, c.train.learning_rate = int(seed), float(lr)
    c.name = cell.id
    c.workdir = os.path.join(results, "runs", cell.id)
    return dataclasses.replace(cell, config=from_dict(c.to_dict()))

  cells = []
  for model, model_overrides in models.items():
    for setting, setting_overrides in settings.items():
      overrides = tuple(model_overrides) + tuple(setting_overrides) + tuple(sweep.overrides)
      cell = functools.partial(make, model, setting, overrides)  # (seed, lr) -> Cell
      rates = tuning_rates(lrs, [int(s) for s in tuning], cell, sweep) if tuning else list(lrs)
      every_rate = {int(s): [cell(s, lr) for lr in rates]
                    for s in dict.fromkeys(tuple(sweep.seeds) + tuning) if not tuning or int(s) in tuning}
      tuned = None
      if tuning and any(int(s) not in tuning for s in sweep.seeds):
        tuned = tuned_rate([c for s in tuning for c in every_rate[s]], sweep.metric, sweep.mode)
      for seed in map(int, sweep.seeds):
        if seed in every_rate:
          cells += every_rate[seed]
        elif tuned is not None:
          cells.append(make(model, setting, overrides, seed, tuned))
  return cells


def beyond(rates, end: str) -> float:
  """The next rate past the top ("high") or bottom ("low") of `rates` at the grid's own ratio there (to 12
  significant digits, so that the same grid always gives the same rate and cell name)."""
  r = sorted(rates)
  nxt = r[-1] * r[-1] / r[-2] if end == "high" else r[0] * r[0] / r[1]
  return float(f"{nxt:.12g}")


def tuning_rates(lrs, tuning, cell, sweep) -> list:
  """The rates the tuning seeds of one (model, setting) run: the grid, plus with `sweep.extend_edges` up to that
  many rates beyond its ends, each added once the tuning seeds have finished every rate so far and their best
  (`tuned_rate`) is the highest or the lowest. cell(seed, lr) -> that seed's Cell at that rate."""
  rates = sorted(float(lr) for lr in lrs)
  for _ in range(sweep.extend_edges):
    best = tuned_rate([cell(s, lr) for s in tuning for lr in rates], sweep.metric, sweep.mode)
    if best is None or rates[0] < best < rates[-1]:
      break
    rates = sorted(rates + [beyond(rates, "high" if best == rates[-1] else "low")])
  return rates if sweep.extend_edges else list(lrs)


def tuning_seeds(sweep) -> tuple:
  """The seeds that tune the rate (`SweepConfig.tune_seeds`); none where the grid has one rate."""
  return tuple(int(s) for s in sweep.tune_seeds) if len(sweep.learning_rates) > 1 else ()


def summary(cell: Cell):
  """A finished cell's summary.json, from its run or its committed record; None otherwise."""
  for run_dir, is_done in ((cell.config.run_dir, finished(cell.config)),
                           (record_dir(cell.config.run_dir), finished_record(cell.config))):
    if is_done:
      with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)
  return None


def final_eval(cell: Cell):
  """The final evaluation (metric -> value) of a finished cell, from its run or its committed record ({} for a
  cell that non-finite steps stopped); None while it has not finished."""
  found = summary(cell)
  if found is not None:
    return found["eval"]
  return {} if nonfinite(cell.config) else None


def tuned_rate(cells, metric: str, mode: str):
  """The learning rate with the best mean final `metric` over the cells of one (model, setting) at each rate
  (the tuning seeds' cells, every rate), or None while one of them has not finished. A rate where any seed
  ended non-finite loses; ties go to the lower rate."""
  by_lr = {}
  for cell in cells:
    result = final_eval(cell)
    if result is None:
      return None
    if result and metric not in result:  # ({} is a cell that non-finite steps stopped: that rate loses)
      raise ConfigError(f"config.sweep.metric {metric!r} is not an eval metric of cell {cell.id}: one of "
                        f"{sorted(k for k in result if '/' not in k)}")
    by_lr.setdefault(cell.lr, []).append(float(result.get(metric, float("nan"))))
  return pick_rate(by_lr, mode)


def pick_rate(by_lr: dict, mode: str) -> float:
  """The rate of {rate: [final metric per seed]} with the best mean ("max" or "min" `mode`); a rate with a
  non-finite value loses, ties go to the lower rate."""
  sign = -1.0 if mode == "max" else 1.0
  score = {lr: sign * float(np.mean(v)) if np.all(np.isfinite(v)) else float("inf") for lr, v in by_lr.items()}
  return min(sorted(score), key=lambda lr: score[lr])


def done(cell: Cell) -> bool:
  """Whether the cell has finished: its run, or its committed record (`gdn.sweep.records`), or non-finite steps
  stopped it (`records.nonfinite`)."""
  return finished(cell.config) or finished_record(cell.config) or bool(nonfinite(cell.config))


def check_trained_as(cell: Cell) -> None:
  """Raise ConfigMismatch if the cell's run or record holds a config that differs from the cell's in a key that
  a resumed run may not change (`gdn.train.workdir.differences`): a finished cell of another config would
  otherwise count as done and enter the report beside cells of this one. Records imported from a results.csv
  hold no whole config and are not compared."""
  for kind, d in (("run", cell.config.run_dir), ("record", record_dir(cell.config.run_dir))):
    saved = saved_config(d)
    if saved is None:
      continue
    summary_path = os.path.join(d, "summary.json")
    if os.path.exists(summary_path):
      with open(summary_path) as f:
        if json.load(f).get("source") == "results.csv":
          continue
    diff = differences(saved, as_json(cell.config))
    if diff:
      shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
      raise ConfigMismatch(f"cell {cell.id}: its {kind} in {d} was trained with another config ({shown}). Give "
                           "this sweep another config.name (its own results directory), or delete that "
                           f"{kind} to train the cell again")


class CorpusMismatch(ValueError):
  """Finished cells of a sweep were trained on another gdn-corpus build than its token files hold now."""


def _trained_corpus(d: str) -> str:
  """`records.corpus_digest` of the summary.json in `d`, "" where there is none (unfinished)."""
  path = os.path.join(d, "summary.json")
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    return corpus_digest(json.load(f))


def check_same_corpus(cells) -> None:
  """Raise CorpusMismatch if a finished cell (its run or its record) was trained on another gdn-corpus build than
  the one its token file's manifest.json describes now. gdn-corpus reads the installation it runs in (the
  standard library and every installed distribution), so a package installed or upgraded since changes the
  bytes, and cells of the two builds would share one table with losses on different validation files. Token
  files that no manifest describes are not compared."""
  current, bad = {}, []
  for cell in cells:
    if cell.config.data.task != "tokens":
      continue
    path = cell.config.data.text.train_file
    if path not in current:
      current[path] = corpus.describe(path) or {}
    want = current[path].get("train", {}).get("sha256", "")
    for d in (cell.config.run_dir, record_dir(cell.config.run_dir)) if want else ():
      got = _trained_corpus(d)
      if got and want[:len(got)] != got:
        bad.append((cell.id, d, got, path, want))
        break
  if bad:
    cell_id, d, got, path, want = bad[0]
    m = current[path]
    raise CorpusMismatch(
        f"{len(bad)} finished cell(s) of this sweep were trained on another corpus than {path} holds now "
        f"(train.bin SHA-256 {want[:12]}, {m['train'].get('files')} files, Python {m.get('python')}, roots "
        f"{m.get('roots')}): {cell_id} on {got[:12]} ({d}/summary.json)"
        + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + ". gdn-corpus reads the installation it runs "
        "in (the standard library and every installed distribution), so an installed or upgraded package changes "
        "it. Build the corpus as the finished cells had it (their summary.json names its Python, roots and file "
        "counts), or give this sweep another config.name (its own results directory)")


def shard_cells(cells, shard: int = 0, num_shards: int = 1) -> list:
  """This shard's cells. Cells that differ only in the seed or the learning rate compile to the same programs,
  so they stay together: the (model, setting) groups are dealt out in turn, and a shard runs its groups' cells
  one after another, every cell after a group's first finding its programs in the compilation cache."""
  return [cell for group in groups(cells)[shard::num_shards] for cell in group]


def groups(cells) -> list:
  """The cells of each (model, setting) in turn, in the order they come."""
  out = {}
  for cell in cells:
    out.setdefault((cell.model, cell.setting), []).append(cell)
  return list(out.values())


def run_cells(cells, shard: int = 0, num_shards: int = 1, log=print, stack: bool = False,
              stack_size: int = 0, only=None) -> None:
  """Trains this shard's cells (`shard_cells`), skipping finished ones; an interrupted cell resumes from its
  checkpoint. A cell stopped by non-finite steps (train.skip_nonfinite) is logged, has no summary and is marked
  (`records.mark_nonfinite`): the sweep counts it done, and its report names it.

  stack: train each (model, setting) group's cells as one program (gdn/train/stacked.py), at most `stack_size`
  cells each (0: the whole group); a group whose cells have all finished is skipped. only: a set of cell ids,
  the shard's cells to train (None: all of them).
  """
  mine = [c for c in shard_cells(cells, shard, num_shards) if only is None or c.id in only]
  for cell in mine:  # before any training: a sweep of mixed configs stops at once
    if done(cell):
      check_trained_as(cell)
  if not all(done(c) for c in mine):  # and one whose corpus changed under its finished cells
    check_same_corpus(cells)
  if stack:
    _run_stacked(mine, stack_size, log)
    return
  for i, cell in enumerate(mine):
    if done(cell):
      log(f"[{i + 1}/{len(mine)}] {cell.id}: done already")
      continue
    log(f"[{i + 1}/{len(mine)}] {cell.id}")
    try:
      train(cell.config, log=log)
    except NonFiniteLoss as e:  # a diverging cell (a learning rate too high) is a result, not the sweep's end
      mark_nonfinite(cell.config.run_dir, str(e))
      log(f"[{i + 1}/{len(mine)}] {cell.id} stopped, left out of the report's means: {e}")


def stacks(cells, stack_size: int = 0) -> list:
  """The cells left to train, cut into the lists that `run_cells(stack=True)` trains as one program each, every
  (model, setting) group in turn. First a group's pieces that have checkpoints (`.stacked/<hash>/`, named by
  its cells.json) and a cell still to train, as they were, so that a relaunch resumes them; then its other
  unfinished cells in pieces of at most `stack_size` (0: all of them). Finished cells join no new piece, so a
  group resumed with most of its cells done computes only the rest."""
  pieces = []
  for group in groups(cells):
    by_id = {c.id: c for c in group}
    taken = set()
    for ids in _checkpointed_pieces(group):
      if set(ids) <= by_id.keys() and not taken & set(ids) and not all(done(by_id[i]) for i in ids):
        pieces.append([by_id[i] for i in ids])
        taken |= set(ids)
    rest = [c for c in group if c.id not in taken and not done(c)]
    size = stack_size or max(len(rest), 1)
    pieces += [rest[i:i + size] for i in range(0, len(rest), size)]
  return pieces


def _checkpointed_pieces(group) -> list:
  """The cell ids of each stacked piece with checkpoints beside the group's run directories, in name order."""
  root = os.path.join(os.path.dirname(os.path.abspath(group[0].config.run_dir)), ".stacked")
  pieces = []
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
    path = os.path.join(root, name, "cells.json")
    if os.path.exists(path) and has_checkpoints(os.path.join(root, name, "checkpoints")):
      with open(path) as f:
        pieces.append(json.load(f))
  return pieces


def _run_stacked(cells, stack_size: int, log) -> None:
  for cell in cells:
    if done(cell):
      log(f"{cell.id}: done already")
  pieces = stacks(cells, stack_size)
  for i, piece in enumerate(pieces):
    log(f"[{i + 1}/{len(pieces)}] stacked: {', '.join(c.id for c in piece)}")
    for cell, summary in zip(piece, train_stacked([c.config for c in piece], log=log)):
      if summary is None:
        mark_nonfinite(cell.config.run_dir, f"non-finite steps stopped it in a stacked program "
                                            f"(train.skip_nonfinite={cell.config.train.skip_nonfinite})")
        log(f"{cell.id} stopped by non-finite steps, left out of the report's means")
