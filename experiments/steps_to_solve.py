"""Steps to solve for every cell of a sweep config: `python -m experiments.steps_to_solve --config FILE.py`.

Each cell (model x setting x seed x learning rate of the config's `sweep` section) trains until its eval
`sweep.metric` reaches --threshold or the config's step budget runs out (gdn.train.solve). Writes
results/<name>/solve.csv (one row per cell) and solve.json (rows and eval curves), with the command.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys

from gdn.sweep import expand
from gdn.train.config_file import apply_overrides, load, split_argv
from gdn.train.solve import steps_to_solve

FIELDS = ("model", "setting", "seed", "lr", "solved_at", "steps_run", "budget", "metric", "final", "final_loss",
          "seconds")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  spec, overrides, rest = split_argv(argv)
  parser = argparse.ArgumentParser(prog="steps_to_solve", description=__doc__.split("\n")[0])
  parser.add_argument("--threshold", type=float, default=0.99)
  parser.add_argument("--eval_every", type=int, default=100)
  parser.add_argument("--shard", default="0/1", help="i/n: run every n-th cell from the i-th")
  args = parser.parse_args(rest)
  config = apply_overrides(load(spec), overrides)
  shard, num_shards = (int(x) for x in args.shard.split("/"))
  out_dir = os.path.join("results", config.name)
  os.makedirs(out_dir, exist_ok=True)
  suffix = "" if num_shards == 1 else f"_shard{shard}of{num_shards}"
  command = "python -m experiments.steps_to_solve " + shlex.join(argv)
  rows, curves = [], []
  metric = config.sweep.metric
  for cell in expand(config, results=out_dir)[shard::num_shards]:
    r = steps_to_solve(cell.config, metric=metric, threshold=args.threshold, eval_every=args.eval_every)
    rows.append(dict(model=cell.model, setting=cell.setting, seed=cell.seed, lr=cell.lr, solved_at=r["solved_at"],
                     steps_run=r["final"]["step"], budget=cell.config.train.last_step, metric=metric,
                     final=r["final"][metric], final_loss=r["final"]["loss"], seconds=round(r["seconds"], 1)))
    curves.append(dict(cell=cell.id, curve=r["curve"]))
    with open(os.path.join(out_dir, f"solve{suffix}.csv"), "w", newline="") as f:
      w = csv.DictWriter(f, FIELDS)
      w.writeheader()
      w.writerows(rows)
    with open(os.path.join(out_dir, f"solve{suffix}.json"), "w") as f:
      json.dump(dict(command=command, threshold=args.threshold, eval_every=args.eval_every, rows=rows,
                     curves=curves), f, indent=1)
  print(f"results  {out_dir}/solve{suffix}.csv, solve{suffix}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
