"""Run a sweep and report it: `gdn-compare --config configs/mqar.py:small`.

Cells are models x settings x seeds x learning rates from the config's `sweep` section; results go to
results/<config.name>/ (runs/, records/, table.md, results.csv, best.csv, PNG plots). Finished cells are skipped and
interrupted ones resume, so the command can simply be run again. The report keeps a record of each finished run
(records/<cell>/: its summary, config and thinned metrics), which is committed with the report where the runs are
not: a report written elsewhere still has every cell, and a cell with a finished record is not trained again;
`--import-csv` makes records from an older report's results.csv. `--shard i/n` runs every n-th (model, setting)
group of cells from the i-th (one machine or process each; a group's seeds and learning rates share compiled
programs, so they stay on one shard); `--stack` trains each group's cells as one program (gdn/train/stacked.py;
`--stack-size K`: at most K cells each); `--cells ID,...` trains only those cells; `--report` only writes the
report from the runs and records present.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from gdn.sweep import expand, records, run_cells, write_report
from gdn.sweep.grid import CorpusMismatch
from gdn.train import ConfigError, compile_cache
from gdn.train.checkpoint import ConfigMismatch, NoUsableCheckpoint
from gdn.train.config_file import apply_overrides, load, split_argv
from gdn.train.workdir import WorkdirLocked


def _parallel_hint(argv_config, overrides, n_cells) -> str:
  base = "gdn-compare --config " + shlex.quote(argv_config) + "".join(
      " " + shlex.quote(f"--config.{o}") for o in overrides)
  return (f"{n_cells} cells. To spread them over N machines (each with this repository installed), run on "
          f"machine i = 0..N-1:\n  {base} --shard i/N\nthen copy every machine's results/<name>/runs/ into one "
          f"results/<name>/runs/ and write the report with:\n  {base} --report")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    spec, overrides, rest = split_argv(argv)
    parser = argparse.ArgumentParser(prog="gdn-compare",
                                     usage="gdn-compare --config FILE.py[:ARG] [--config.KEY=VALUE ...] [options]",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shard", default="0/1",
                        help="i/n: run every n-th (model, setting) group of cells, starting at the i-th")
    parser.add_argument("--report", action="store_true", help="only write the report from finished runs")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--import-csv", action="store_true",
                        help="write records (results/<name>/records/) for the rows of the sweep's results.csv whose "
                             "cells have none (a report from before records were kept), then exit")
    parser.add_argument("--stack", action="store_true",
                        help="train each (model, setting) group's seeds and learning rates as one program")
    parser.add_argument("--stack-size", type=int, default=0,
                        help="with --stack: at most this many cells per program (0: the whole group)")
    parser.add_argument("--cells", default="",
                        help="ID,ID,...: train only these cells of the shard (ids as --list prints them); the "
                             "report still covers the whole sweep")
    args = parser.parse_args(rest)
    if not spec:
      raise ConfigError("--config is required (e.g. --config configs/mqar.py:small)")
    config = apply_overrides(load(spec), overrides)
    try:
      shard, num_shards = (int(x) for x in args.shard.split("/"))
    except ValueError:
      shard, num_shards = 0, 0
    if not 0 <= shard < num_shards:
      raise ConfigError(f"--shard must be i/n with 0 <= i < n, got {args.shard!r}")
    if args.stack_size < 0 or (args.stack_size and not args.stack):
      raise ConfigError(f"--stack-size must be >= 0 and goes with --stack, got {args.stack_size}")
    cells = expand(config)
    only = [i for i in args.cells.split(",") if i]
    unknown = sorted(set(only) - {c.id for c in cells})
    if unknown:
      raise ConfigError(f"--cells: no cell {', '.join(map(repr, unknown))} in this sweep (--list prints its cells)")
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out_dir = os.path.join("results", config.name)
  print(_parallel_hint(spec, overrides, len(cells)))
  if args.list:
    for c in cells:
      print(c.id)
    return 0
  if args.import_csv:
    if not os.path.exists(os.path.join(out_dir, "results.csv")):
      print(f"error: --import-csv: no {out_dir}/results.csv", file=sys.stderr)
      return 2
    print(f"{len(records.import_csv(out_dir))} records written to {out_dir}/records/")
    return 0
  if not args.report:
    if cells:
      compile_cache.enable(cells[0].config.compilation_cache, cells[0].config.run_dir)
    try:
      run_cells(cells, shard, num_shards, stack=args.stack, stack_size=args.stack_size, only=set(only) or None)
    except (ConfigError, ConfigMismatch, CorpusMismatch, NoUsableCheckpoint, WorkdirLocked) as e:  # as gdn-train does
      print(f"error: {e}", file=sys.stderr)
      return 2
  try:
    paths = write_report(cells, out_dir, title=config.name)
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:  # a sweep.metric that no cell has
    print(f"error: {e}", file=sys.stderr)
    return 2
  with open(paths["table.md"]) as f:
    print("\n" + f.read())
  print(f"results   {out_dir}/  (table.md, results.csv, best.csv)")
  print("plots     " + ", ".join(p for k, p in paths.items() if k.endswith(".png")))
  print(f"records   {out_dir}/records/<cell>/  (what the report reads of each run: commit them with it)")
  print(f"runs      {out_dir}/runs/<cell>/  (config.json, metrics.jsonl, tb/, checkpoints/"
        + (f"; with --stack the checkpoints are each group's, in {out_dir}/runs/.stacked/)" if args.stack else ")"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
