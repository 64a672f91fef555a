"""A finished cell's record: what a sweep's report reads of its run, kept under results/<name>/records/<cell id>/
beside the report, so that it can be committed with it (the run directories, with their checkpoints and event
files, are not). A report written on another machine, or after the runs were deleted, still has every cell, and
a sweep continued there trains only the cells that have neither a finished run nor a finished record.

A record holds the run's summary.json and config.json as they are, and its metrics.jsonl with every evaluation
and at most MAX_TRAIN_POINTS of the training records (evenly spaced, the last one kept).
"""

from __future__ import annotations

import json
import os
import shutil

from gdn.train.metrics import read_jsonl
from gdn.train.workdir import finished

MAX_TRAIN_POINTS = 200
NONFINITE = "nonfinite.json"  # a sweep's mark of a cell that non-finite steps stopped: a result, trained no more
COPIED = ("summary.json", "config.json", NONFINITE)


def corpus_digest(summary: dict) -> str:
  """The gdn-corpus train.bin SHA-256 that a run's summary names ("" for other data; records imported from a
  results.csv keep its first 12 hex digits)."""
  return ((summary.get("corpus") or {}).get("train") or {}).get("sha256", "")


def record_dir(run_dir: str) -> str:
  """results/<name>/records/<cell id> for the run directory results/<name>/runs/<cell id>."""
  run_dir = os.path.normpath(run_dir)
  return os.path.join(os.path.dirname(os.path.dirname(run_dir)), "records", os.path.basename(run_dir))


def save(run_dir: str) -> str:
  """Writes (or rewrites) the record of the run in `run_dir`; returns its directory."""
  dest = record_dir(run_dir)
  os.makedirs(dest, exist_ok=True)
  for name in COPIED:
    if os.path.exists(os.path.join(run_dir, name)):
      shutil.copyfile(os.path.join(run_dir, name), os.path.join(dest, name))
  path = os.path.join(run_dir, "metrics.jsonl")
  records = read_jsonl(path) if os.path.exists(path) else []
  is_eval = [any(k.startswith("eval/") for k in r) for r in records]
  train = [i for i, e in enumerate(is_eval) if not e]
  # Evenly spaced from the first, and the last: at most MAX_TRAIN_POINTS in all.
  every = max(1, -(-(len(train) - 1) // max(MAX_TRAIN_POINTS - 1, 1)))
  keep = set(train[::every]) | set(train[-1:])
  with open(os.path.join(dest, "metrics.jsonl"), "w") as f:
    for i, r in enumerate(records):
      if i in keep or is_eval[i]:
        f.write(json.dumps(r) + "\n")
  return dest


def mark_nonfinite(run_dir: str, why: str) -> None:
  """Marks the cell of `run_dir` as stopped by non-finite steps (`why`, the loop's message): a sweep counts it
  done (a rate that diverged is a result) and its report names it. The run itself stays resumable by gdn-train
  (with a larger train.skip_nonfinite, say) once the mark is deleted."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, NONFINITE), "w") as f:
    json.dump({"stopped": why}, f)


def nonfinite(cfg) -> str:
  """Why the cell of `cfg` was stopped by non-finite steps, from its run's mark or its record's; "" if it was not."""
  for d in (cfg.run_dir, record_dir(cfg.run_dir)):
    path = os.path.join(d, NONFINITE)
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f).get("stopped") or "non-finite steps"
  return ""


def finished_record(cfg) -> bool:
  """Whether the cell of `cfg` has a record of a finished run (the rule of `gdn.train.workdir.finished`)."""
  return finished(cfg, record_dir(cfg.run_dir))


def import_csv(out_dir: str) -> list:
  """Records for the rows of an earlier report's `out_dir`/results.csv whose cells have none, from the row alone:
  its summary (steps, parameters, whether it stopped early, the corpus digest, every final eval value; marked
  "source": "results.csv") and the schedule it ran (its config.json's train steps and stop step), with no metrics
  history. For sweeps reported before records existed, whose run directories are gone (`gdn-compare --import-csv`):
  a report written later keeps their final numbers, not their curves. Returns the record directories written."""
  import csv

  from gdn.sweep.grid import cell_id  # grid imports this module

  written = []
  with open(os.path.join(out_dir, "results.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    dest = os.path.join(out_dir, "records", cell_id(row["model"], row["setting"], int(row["seed"]), float(row["lr"])))
    if os.path.exists(os.path.join(dest, "summary.json")):
      continue
    steps = int(float(row["steps"]))
    summary = dict(steps=steps, params=int(float(row["params"])), stopped_early=row.get("stopped_early") == "True",
                   eval={k[len("eval/"):]: float(v) for k, v in row.items() if k.startswith("eval/") and v != ""},
                   source="results.csv")
    if row.get("corpus"):
      summary["corpus"] = {"train": {"sha256": row["corpus"]}}
    schedule = int(float(row.get("schedule_steps") or steps))
    budget = int(float(row.get("budget") or schedule))
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    with open(os.path.join(dest, "config.json"), "w") as f:
      json.dump({"train": {"steps": schedule, "stop_step": budget if budget != schedule else None}}, f, indent=1)
    written.append(dest)
  return written
