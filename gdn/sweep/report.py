"""A sweep's report: the best learning rate per (model, setting, seed), a markdown table of the mean ± std over
seeds with the rates each cell picked, the same for every rate of the grid, the metric at every evaluation, CSVs,
and PNG plots with error bars over seeds, a shared y axis and the task's chance level (the metric against a
config value, against the eval length where the splits are lengths, loss curves, eval curves)."""

from __future__ import annotations

import csv
import json
import os
import re

import numpy as np

from gdn.data import make_task
from gdn.sweep import published, records
from gdn.sweep.grid import pick_rate, tuning_seeds
from gdn.train.config import to_dict
from gdn.train.metrics import read_jsonl
from gdn.train.workdir import finished


def _get(d: dict, dotted: str):
  for part in dotted.split("."):
    d = d[part]
  return d


def _natural(name: str) -> list:
  """T64 before T128."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def collect(cells) -> list:
  """One row per finished cell: its ids, learning rate, config value of x_key, and final eval metrics. A cell
  with a summary in its run directory gets its record written (`gdn.sweep.records`), unless the run has not
  finished and the record is of one that has (from another machine: never overwritten by less); a cell without
  is read from its record where it has one. run_dir is the record's directory, which every row then has."""
  rows = []
  for cell in cells:
    src = cell.config.run_dir
    if os.path.exists(os.path.join(src, "summary.json")) and (
        finished(cell.config) or not records.finished_record(cell.config)):
      src = records.save(src)
    elif os.path.exists(os.path.join(src, records.NONFINITE)):  # stopped by non-finite steps: a record, no row
      records.save(src)
      continue
    else:
      src = records.record_dir(src)
    path = os.path.join(src, "summary.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      summary = json.load(f)
    x_key = cell.config.sweep.x_key
    rows.append(dict(model=cell.model, setting=cell.setting, seed=cell.seed, lr=cell.lr,
                     x=_get(to_dict(cell.config), x_key) if x_key else None, run_dir=src,
                     params=summary["params"], steps=summary["steps"], **_budget(cell, src),
                     stopped_early=bool(summary.get("stopped_early")), corpus=_corpus(summary),
                     **{f"eval/{k}": v for k, v in summary["eval"].items()}))
  return rows


def _corpus(summary) -> str:
  """The first 12 hex digits of the gdn-corpus train file's SHA-256, "" for other data."""
  return records.corpus_digest(summary)[:12]


def _corpora(rows) -> str:
  """The table's note of the corpus its runs trained on; where they differ (a corpus rebuilt in another
  installation, `gdn.sweep.grid.check_same_corpus`), a warning with each digest's runs."""
  by = {}
  for r in rows:
    if r["corpus"]:
      by.setdefault(r["corpus"], []).append(os.path.basename(r["run_dir"]))
  if len(by) <= 1:
    return "".join(f" Corpus (train.bin SHA-256): {c}." for c in by)
  major = max(by, key=lambda c: len(by[c]))
  return (f" **Not comparable: the runs trained on {len(by)} different corpora** (train.bin SHA-256 {major}: "
          f"{len(by[major])} runs; " + "; ".join(f"{c}: {', '.join(sorted(ids))}" for c, ids in sorted(by.items())
                                                 if c != major) + ").")


def _budget(cell, src: str) -> dict:
  """The run's schedule length and the step it was to stop at, from the config it ran with (in `src`, its record;
  a sweep may be run in pieces with different `train.stop_step` cuts than the config the report is written from)."""
  train = to_dict(cell.config)["train"]
  path = os.path.join(src, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      train = json.load(f).get("train", train)
  return dict(schedule_steps=train["steps"], budget=train.get("stop_step") or train["steps"])


def best_per_seed(rows, metric: str, mode: str) -> list:
  """Zoology's protocol: for each (model, setting, seed) keep the learning rate with the best final metric."""
  best = {}
  sign = 1.0 if mode == "max" else -1.0
  for r in rows:
    key = (r["model"], r["setting"], r["seed"])
    value = r.get(f"eval/{metric}", float("nan"))
    if key not in best or sign * value > sign * best[key].get(f"eval/{metric}", float("nan")) or \
        np.isnan(best[key].get(f"eval/{metric}", float("nan"))):
      best[key] = r
  return list(best.values())


def _grid_of(grid, key) -> list:
  """The rates of (model, setting) `key`: grid[key] where `grid` is a dict of each group's rates, else grid."""
  return list(grid.get(key, ())) if isinstance(grid, dict) else list(grid)


def at_tuned_rate(rows, tuning, grid, metric: str, mode: str, stopped=()):
  """The tuned protocol (`sweep.tune_seeds`): for each (model, setting) the rows of every seed at the rate with
  the best mean over the tuning seeds (`gdn.sweep.grid.pick_rate`, over the rates they have finished so
  far; a rate where one of them was stopped by non-finite steps, `stopped` holding its (model, setting, seed,
  lr), loses), and the groups whose tuning seeds have not finished every rate of `grid` (their pick may still
  change). grid: the rates, or {(model, setting): its rates} where groups differ (`sweep.extend_edges`)."""
  tuning = set(tuning)
  by_group = {}
  for r in rows:
    by_group.setdefault((r["model"], r["setting"]), []).append(r)
  out, unfinished = [], []
  for key, rs in by_group.items():
    by_lr = {}
    for model, setting, seed, lr in stopped:
      if (model, setting) == key and seed in tuning:
        by_lr.setdefault(lr, []).append(np.nan)
    for r in rs:
      if r["seed"] in tuning:
        by_lr.setdefault(r["lr"], []).append(float(r.get(f"eval/{metric}", np.nan)))
    if not by_lr:
      continue
    if len(tuning) * len(_grid_of(grid, key)) > sum(len(v) for v in by_lr.values()):
      unfinished.append(key)
    pick = pick_rate(by_lr, mode)
    out += [r for r in rs if r["lr"] == pick]
  return out, unfinished


def summarize(rows, metric: str, by=("model", "setting")) -> dict:
  """key (the values of `by`) -> (mean, std, n, the runs' learning rates) over seeds."""
  groups = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in by), []).append(r)
  out = {}
  for key, rs in groups.items():
    v = np.array([r.get(f"eval/{metric}", np.nan) for r in rs], float)
    out[key] = (float(np.mean(v)), float(np.std(v)), len(rs), [r["lr"] for r in rs])
  return out


def median_rate(rows, model: str, setting: str, metric: str, mode: str):
  """(lr, best, median, median absolute deviation, seeds) at the rate whose median over seeds is best, as
  Grazzi et al. pick it (their Table 3 gives that rate's best seed, Table 5 its median ± MAD); None without
  runs."""
  by_lr = {}
  for r in rows:
    if r["model"] == model and r["setting"] == setting:
      by_lr.setdefault(r["lr"], []).append(r.get(f"eval/{metric}", np.nan))
  if not by_lr:
    return None
  pick, worst = (max, -np.inf) if mode == "max" else (min, np.inf)
  lr = pick(sorted(by_lr), key=lambda lr: np.nan_to_num(np.median(by_lr[lr]), nan=worst))
  v = np.array(by_lr[lr], float)
  med = float(np.median(v))
  best = np.nanmax(v) if mode == "max" else np.nanmin(v)
  return lr, float(best), med, float(np.median(np.abs(v - med))), len(v)


def _by_model_and_setting(models, settings, text) -> list:
  """A markdown table, one row per model and one column per setting, the cells `text(model, setting)`."""
  return ["| model | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"] + [
      f"| {m} | " + " | ".join(text(m, s) for s in settings) + " |" for m in models]


def _label(key, settings) -> str:
  """A (model, setting) as "model", or "model/setting" where the sweep has several settings."""
  return key[0] if len(settings) < 2 else f"{key[0]}/{key[1]}"


def _cell(mean: float, std: float, n: int) -> str:
  return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def _rates(lrs) -> str:
  """The learning rates the seeds picked: "1e-03" or "1e-03 ×2, 3e-03"."""
  counts = {lr: lrs.count(lr) for lr in sorted(set(lrs))}
  return ", ".join(f"{lr:.0e}" + (f" ×{n}" if n > 1 else "") for lr, n in counts.items())


def grid_edges(summary: dict, grid, several_settings: bool = False) -> list:
  """For each (model, setting) whose seeds picked a rate at an end of a grid of three or more: "model: k of n
  seeds at the lowest rate (1e-03)" (and/or the highest), where the best rate may lie outside the grid. grid:
  the rates, or {(model, setting): its rates}."""
  out = []
  for (model, setting), (_, _, n, lrs) in summary.items():
    rates = sorted(_grid_of(grid, (model, setting)))
    if len(rates) < 3:
      continue
    parts = [f"{k} of {n} seed{'s' if n > 1 else ''} at the {end} ({lr:.0e})"
             for end, lr in (("lowest", rates[0]), ("highest", rates[-1])) for k in [lrs.count(lr)] if k]
    if parts:
      out.append(f"{model}{'/' + setting if several_settings else ''}: " + ", ".join(parts))
  return out


def chance_level(cells, metric: str):
  """The accuracy of guessing for an accuracy metric of the sweep's task (None for other metrics or tasks, or
  where the settings' chance levels differ, as over vocabularies); 0 for scaled_accuracy, which is 0 there."""
  if metric not in ("accuracy", "last_accuracy", "scaled_accuracy") or cells[0].config.data.task in ("bytes",
                                                                                                     "tokens"):
    return None
  levels = {make_task(d, 0, 1).chance for d in {c.config.data for c in cells}}
  if metric == "scaled_accuracy":
    return 0.0 if all(levels) else None
  return levels.pop() or None if len(levels) == 1 else None


def train_length(cells):
  """The longest training sequence, for the tasks that evaluate beyond it (a line in the length plot)."""
  d = cells[0].config.data
  return {"state": d.state.train_lengths[-1], "niah": max(d.niah.train_lengths)}.get(d.task)


def write_report(cells, out_dir: str, title: str = "") -> dict:
  """Writes table.md, results.csv (every run), best.csv (best lr per seed) and plots; returns paths."""
  os.makedirs(out_dir, exist_ok=True)
  sweep = cells[0].config.sweep
  metric, mode = sweep.metric, sweep.mode
  rows = collect(cells)
  if not rows:
    raise FileNotFoundError(f"no finished runs under {out_dir}/runs or {out_dir}/records")
  if not any(f"eval/{metric}" in r for r in rows):  # before any file of the report is rewritten
    names = sorted({k[5:] for r in rows for k in r if k.startswith("eval/") and "/" not in k[5:]})
    raise ValueError(f"config.sweep.metric {metric!r} is in no finished cell's eval metrics: one of {names}")
  has_row = {(r["model"], r["setting"], r["seed"], r["lr"]) for r in rows}
  stopped = [c for c in cells if (c.model, c.setting, c.seed, c.lr) not in has_row and records.nonfinite(c.config)]
  grid = sorted({c.lr for c in cells})
  tuning = tuning_seeds(sweep)
  grids = {}  # each (model, setting)'s own rates: its tuning seeds' (every seed's without tuning)
  for c in cells:
    if not tuning or c.seed in tuning:
      grids.setdefault((c.model, c.setting), set()).add(c.lr)
  grids = {key: sorted(v) for key, v in grids.items()}
  if tuning:
    best, unfinished = at_tuned_rate(rows, tuning, grids, metric, mode,
                                     [(c.model, c.setting, c.seed, c.lr) for c in stopped])
  else:
    best, unfinished = best_per_seed(rows, metric, mode), []
  summary = summarize(best, metric)
  chance = chance_level(cells, metric)
  models = list(dict.fromkeys(c.model for c in cells))
  settings = list(dict.fromkeys(c.setting for c in cells))
  splits = sorted({k.split("/")[1] for r in rows for k in r if k.count("/") == 2 and k.startswith("eval/")
                   and k.endswith("/" + metric)}, key=_natural)

  no_history = [r for r in rows if not os.path.exists(os.path.join(r["run_dir"], "metrics.jsonl"))]
  paths = {}
  keys = list(dict.fromkeys(k for r in rows for k in r))
  for name, rs in (("results.csv", rows), ("best.csv", best)):
    paths[name] = os.path.join(out_dir, name)
    with open(paths[name], "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=keys, restval="")
      w.writeheader()
      w.writerows(rs)

  extended = sorted(set(grid) - set(float(lr) for lr in sweep.learning_rates))
  protocol = (f"every seed at the rate whose mean over seed{'s' if len(tuning) > 1 else ''} "
              f"{', '.join(map(str, tuning))} is best, from {sorted(float(lr) for lr in sweep.learning_rates)}"
              + (f", widened beyond an end where that end was best (sweep.extend_edges={sweep.extend_edges}: "
                 + "; ".join(f"{_label(k, settings)} {[lr for lr in g if lr in extended]}"
                             for k, g in grids.items() if set(g) & set(extended)) + ")" if extended else "")
              + " (the other seeds ran that rate only); the rate below"
              if tuning else f"each seed at its best learning rate from {grid}; the rates picked below")
  lines = [f"# {title or os.path.basename(out_dir)}", "",
           f"Final eval `{metric}`: mean ± std over {len(sweep.seeds)} seed(s) (std over seeds, ddof 0), "
           f"{protocol}."
           + (f" Still tuning (seed{'s' if len(tuning) > 1 else ''} {', '.join(map(str, tuning))} "
              f"{'have' if len(tuning) > 1 else 'has'} not finished every rate, so the rate may change): "
              + ", ".join(_label(key, settings) for key in unfinished) + "." if unfinished else "")
           + ("" if chance is None else f" Chance: {chance:.4g}.")
           + f" Runs finished: {len(rows)} of {len(cells)}."
           + (f" Stopped by non-finite steps, so without a result (their rate lost): "
              f"{', '.join(c.id for c in stopped)}." if stopped else "")
           + (f" {len(no_history)} of them have no metrics history (records of an earlier results.csv, "
              "`gdn.sweep.records.import_csv`): their curves and per-evaluation values are missing."
              if no_history else "")
           + _corpora(rows), ""]

  def best_rates(m, s):
    if (m, s) not in summary:
      return "–"
    mean, std, n, lrs = summary[(m, s)]
    return f"{_cell(mean, std, n)} (lr {_rates(lrs)})"

  lines += _by_model_and_setting(models, settings, best_rates)
  edges = grid_edges(summary, grids, len(settings) > 1)
  if edges:
    lines += ["", "Picked at an end of the rate grid, so the best rate may lie outside it (a grid widened for every "
              "model would tell): " + "; ".join(edges) + "."]
  for spec in sweep.published.values():  # the first setting's numbers beside each published table
    if "by_split" in spec:  # after the per-split table below
      continue
    ours = {}
    for r in best:
      if r["setting"] == settings[0]:
        ours.setdefault(r["model"], []).append(float(np.array(r.get(f"eval/{metric}", np.nan), float)))
    lines += [""] + published.table(spec, ours, metric)
  tc = cells[0].config.train
  if tc.early_stop > 0:
    lines += ["", f"Steps trained until eval `{tc.early_stop_metric}` reached {tc.early_stop} (mean ± std over the "
              f"seeds that reached it at their best rate; solved seeds / seeds; the budget row gives the steps each "
              "setting's runs were allowed, and the schedule's length where a run was cut before its end):", ""]

    def steps_to_solve(m, s):
      rs = [r for r in best if r["model"] == m and r["setting"] == s]
      solved = [r["steps"] for r in rs if r["stopped_early"]]
      # whole steps: a mean of 2333.333 claims precision that a 500-step evaluation interval does not have
      spread = f" ± {np.std(solved):,.0f}" if len(solved) > 1 else ""
      return "–" if not rs else (f"{np.mean(solved):,.0f}{spread}" if solved else "never") + \
          f" ({len(solved)}/{len(rs)})"

    lines += _by_model_and_setting(models, settings, steps_to_solve)

    def budget(s):
      cuts = sorted({(r["budget"], r["schedule_steps"]) for r in rows if r["setting"] == s})
      return ", ".join(f"{b}" if b == n else f"{b} of {n}" for b, n in cuts) or "–"

    lines.append("| budget | " + " | ".join(budget(s) for s in settings) + " |")
  lrs = grid
  if len(lrs) > 1:  # a winner that flips with the rate shows here
    by_lr = summarize(rows, metric, by=("model", "setting", "lr"))
    lines += ["", f"Every learning rate (`{metric}`, mean ± std over seeds):", "",
              "| model | setting | " + " | ".join(f"lr {lr:.1e}" for lr in lrs) + " |",
              "|---" * (len(lrs) + 2) + "|"]
    for m in models:
      for s in settings:
        if any((m, s, lr) in by_lr for lr in lrs):
          lines.append(f"| {m} | {s} | " + " | ".join(
              _cell(*by_lr[(m, s, lr)][:3]) if (m, s, lr) in by_lr else "–" for lr in lrs) + " |")
  if len(sweep.seeds) > 1 and not tuning:  # (tuned: the seeds after the tuning ones ran one rate)
    lines += ["", f"One rate per cell, the one whose median over seeds is best (Grazzi et al.'s rule): the best "
              f"seed; the median ± median absolute deviation (`{metric}`):", ""]

    def median_rate_text(m, s):
      r = median_rate(rows, m, s, metric, mode)
      return "–" if r is None else f"{r[1]:.3f}; {r[2]:.3f} ± {r[3]:.3f} (lr {r[0]:.0e}, {r[4]} seeds)"

    lines += _by_model_and_setting(models, settings, median_rate_text)
  if splits:
    lines += ["", f"Per eval split (`{metric}`, mean ± std over seeds at their best rates):", "",
              "| model | setting | " + " | ".join(splits) + " |", "|---" * (len(splits) + 2) + "|"]
    for m in models:
      for s in settings:
        rs = [r for r in best if r["model"] == m and r["setting"] == s]
        if rs:
          vals = [[r[f"eval/{sp}/{metric}"] for r in rs if f"eval/{sp}/{metric}" in r] for sp in splits]
          lines.append(f"| {m} | {s} | " + " | ".join(_cell(np.mean(v), np.std(v), len(v)) if v else "–"
                                                       for v in vals) + " |")
    for spec in sweep.published.values():  # the first setting's per-split numbers beside the paper's
      if "by_split" in spec:
        ours = {}
        for r in best:
          if r["setting"] == settings[0]:
            for sp in splits:
              ours.setdefault(r["model"], {}).setdefault(sp, []).append(float(r.get(f"eval/{sp}/{metric}", np.nan)))
        lines += [""] + published.split_table(spec, ours, metric, splits)
  steps = sorted({step for r in best for step in _eval_history(r, metric)})
  if len(steps) > 1:  # the metric at every evaluation shows what a final number hides (e.g. overfitting)
    lines += ["", f"`{metric}` at each evaluation (best learning rate, mean over seeds; the last column is the "
              f"final value above unless a run stopped early):", "",
              "| model | setting | " + " | ".join(f"step {t}" for t in steps) + " |", "|---" * (len(steps) + 2) + "|"]
    for m in models:
      for s in settings:
        rs = [r for r in best if r["model"] == m and r["setting"] == s]
        if rs:
          hs = [_eval_history(r, metric) for r in rs]
          vals = [np.mean([h.get(t, np.nan) for h in hs]) for t in steps]
          lines.append(f"| {m} | {s} | " + " | ".join("–" if np.isnan(v) else f"{v:.3f}" for v in vals) + " |")
  paths["table.md"] = os.path.join(out_dir, "table.md")
  with open(paths["table.md"], "w") as f:
    f.write("\n".join(lines) + "\n")

  by_split = {m: dict(v) for spec in sweep.published.values() if "by_split" in spec
              for m, v in spec["by_split"].items()}
  paths.update(_plots(best, models, settings, splits, metric, sweep.x_key, out_dir, chance, train_length(cells),
                      by_split))
  return paths


def _eval_history(row, metric: str) -> dict:
  """step -> the run's eval `metric` at that step, from its metrics.jsonl."""
  path = os.path.join(row["run_dir"], "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  return {r["step"]: r[f"eval/{metric}"] for r in read_jsonl(path) if f"eval/{metric}" in r}


def length_groups(splits) -> dict:
  """The eval splits that are lengths, grouped by task: {"": {"T64": 64, ...}} for splits named `T<n>`,
  {"sniah1": {"sniah1_T1024": 1024, ...}, ...} for `<task>_T<n>`; {} unless every split is one and every group
  has two lengths or more (a plot against the length needs two)."""
  groups = {}
  for sp in splits:
    m = re.fullmatch(r"(?:(.+)_)?T(\d+)", sp)
    if not m:
      return {}
    groups.setdefault(m.group(1) or "", {})[sp] = int(m.group(2))
  return groups if groups and all(len(g) > 1 for g in groups.values()) else {}


def _plots(best, models, settings, splits, metric, x_key, out_dir, chance=None, trained=None, paper=None):
  """Mean over seeds with ± std error bars (bands for curves); panels share their y axis; a dotted line at
  `chance` where the metric has one, a dashed one at the longest training length `trained`. paper: model ->
  {eval split: value}, drawn dashed beside that model's own line in the metric-vs-length plot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = {}
  if x_key:
    panels = splits or [""]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, sp in zip(axes[0], panels):
      key = f"eval/{sp}/{metric}" if sp else f"eval/{metric}"
      for m in models:
        pts = {}
        for r in best:
          if r["model"] == m and r["x"] is not None and key in r:
            pts.setdefault(r["x"], []).append(r.get(key, np.nan))
        if pts:
          xs = sorted(pts)
          ax.errorbar(xs, [np.mean(pts[x]) for x in xs], yerr=[np.std(pts[x]) for x in xs], marker="o",
                      capsize=3, label=m)
      if chance is not None:
        ax.axhline(chance, color="gray", ls=":", lw=1, label="chance")
      ax.set_xscale("log", base=2)
      ax.set_xlabel(x_key)
      ax.set_title(sp or metric)
      ax.set_ylabel(metric)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths["metric_vs_x.png"] = os.path.join(out_dir, f"{metric}_vs_{x_key.split('.')[-1]}.png")
    fig.savefig(paths["metric_vs_x.png"], dpi=120)
    plt.close(fig)

  def per_setting(name, ylabel, draw, log=False, xlabel="step"):
    """One panel per setting, `draw(ax, setting)` plotting every model's curve into it."""
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.4), squeeze=False, sharey=True)
    for ax, s in zip(axes[0], settings):
      draw(ax, s)
      ax.set_title(s)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(ylabel)
      if log:
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:  # none where no run has that history (imported records)
      axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths[name] = os.path.join(out_dir, name)
    fig.savefig(paths[name], dpi=120)
    plt.close(fig)

  def losses(ax, s):
    for m in models:
      rs = [r for r in best if r["model"] == m and r["setting"] == s]
      path = os.path.join(rs[0]["run_dir"], "metrics.jsonl") if rs else ""
      records = [x for x in read_jsonl(path) if "train/loss" in x] if os.path.exists(path) else []
      if records:
        ax.plot([x["step"] for x in records], [x["train/loss"] for x in records], label=m, lw=1)

  curves = {}
  for r in best:
    curves.setdefault((r["model"], r["setting"]), []).append(_eval_history(r, metric))

  def evals(ax, s):
    for m in models:
      hs = [h for h in curves.get((m, s), []) if h]
      if hs:
        steps = sorted({t for h in hs for t in h})
        v = np.array([[h.get(t, np.nan) for t in steps] for h in hs])
        mean, std = np.nanmean(v, axis=0), np.nanstd(v, axis=0)
        line, = ax.plot(steps, mean, marker="o", label=m, lw=1)
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    if chance is not None:
      ax.axhline(chance, color="gray", ls=":", lw=1, label="chance")

  groups = length_groups(splits)

  def by_length(ax, s, lengths):
    """The final metric at each eval length: generalisation beyond the training lengths."""
    for m in models:
      rs = [r for r in best if r["model"] == m and r["setting"] == s]
      pts = {T: [r[f"eval/{sp}/{metric}"] for r in rs if f"eval/{sp}/{metric}" in r] for sp, T in lengths.items()}
      xs = sorted(T for T, v in pts.items() if v)
      color = None
      if xs:
        bars = ax.errorbar(xs, [np.mean(pts[T]) for T in xs], yerr=[np.std(pts[T]) for T in xs], marker="o", ms=3,
                           capsize=3, label=m)
        color = bars[0].get_color()
      ref = (paper or {}).get(m, {})
      pub = sorted((T, ref[sp]) for sp, T in lengths.items() if sp in ref)
      if pub:
        ax.plot([T for T, _ in pub], [v for _, v in pub], ls="--", marker="x", color=color, lw=1,
                label=f"{m} (paper)")
    if chance is not None:
      ax.axhline(chance, color="gray", ls=":", lw=1, label="chance")
    if trained:
      ax.axvline(trained, color="red", ls="--", lw=1, label="longest training length")
    ax.set_xscale("log", base=2)

  def length_plot(name):
    """One panel per setting and task group, every panel on one y axis: one row of settings where the splits
    are lengths alone (`T<n>`), else a row per setting with a panel per task."""
    rows, cols = (1, len(settings)) if len(groups) == 1 else (len(settings), len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False, sharey=True)
    panels = [(s, g) for s in settings for g in groups]
    for ax, (s, g) in zip(axes.flat, panels):
      by_length(ax, s, groups[g])
      ax.set_title(": ".join(x for x in ((s if len(settings) > 1 or not g else ""), g) if x))
      ax.set_xlabel("eval length")
      ax.set_ylabel(metric)
      ax.grid(alpha=0.3)
    legend = {}  # every panel's lines once (a paper may report a model in some panels only)
    for ax in axes.flat:
      for h, label in zip(*ax.get_legend_handles_labels()):
        legend.setdefault(label, h)
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=7)
    fig.tight_layout()
    paths[name] = os.path.join(out_dir, name)
    fig.savefig(paths[name], dpi=120)
    plt.close(fig)

  per_setting("loss_curves.png", "train loss", losses, log=True)
  if groups:
    length_plot(f"{metric}_vs_length.png")
  if any(len(h) > 1 for hs in curves.values() for h in hs):
    per_setting("eval_curves.png", f"eval {metric}", evals)
  return paths
