"""How much of S-NIAH a sliding window answers alone: for each evaluation split of a config, the fraction of its
examples whose needle lies within `--window` tokens of the query (the needle's marker fewer than W positions
before the query's), on exactly the examples that a run of seed `--seed` evaluates. A model whose only retrieval
is a window of W scores these fractions.

  python -m experiments.niah_window --config configs/niah.py --window 512 --seed 0
  python -m experiments.niah_window --config configs/niah.py:small "--config.data.niah.train_lengths=(256,)" \
      "--config.data.niah.eval_lengths=(256,512)" --window 128   # a run trained with these overrides
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from gdn.data import niah
from gdn.train.config_file import resolve, split_argv
from gdn.train.evaluate import EvalSets
from gdn.train.loop import load_task


def within(inputs: np.ndarray, window: int) -> np.ndarray:
  """Per row of S-NIAH token ids [B, T]: whether the needle's marker is fewer than `window` positions before
  the query's."""
  needle = np.argmax(inputs == niah.NEEDLE, axis=1)
  query = np.argmax(inputs == niah.QUERY, axis=1)
  return query - needle < window


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="an S-NIAH config file, e.g. configs/niah.py or configs/niah.py:small; "
                 "--config.key=value overrides follow it, as for gdn-compare")
  p.add_argument("--window", type=int, required=True, help="the window W in tokens")
  p.add_argument("--seed", type=int, default=0, help="the run seed whose evaluation examples are counted")
  spec, overrides, rest = split_argv(sys.argv[1:] if argv is None else list(argv))
  a = p.parse_args(rest)
  if not spec:
    p.error("--config is required (an S-NIAH config file, e.g. configs/niah.py)")
  if a.window < 1:
    p.error(f"--window must be a positive number of tokens, got {a.window}")
  cfg = resolve(spec, tuple(overrides) + (f"seed={a.seed}",))
  if cfg.data.task != "niah":
    p.error(f"--config must be an S-NIAH config (data.task 'niah'), got data.task {cfg.data.task!r}")
  task = load_task(cfg, log=lambda *_: None)
  sets = EvalSets(task, cfg.data.eval_batch, cfg.seed)  # the batches a run of this seed evaluates
  shown = " ".join([spec, *(f"--config.{o}" for o in overrides)])
  print(f"# {shown}, seed {a.seed}: examples whose needle is within {a.window} tokens of the query")
  print("| split | examples | within the window |")
  print("|---|---:|---:|")
  rows = []
  for split in task.evals:
    batches = sets.batches(split)
    inputs = np.concatenate([b["inputs"] for b in batches])
    real = np.concatenate([b["weights"] for b in batches]).sum(1) > 0  # not the padding rows of a last batch
    fraction = float(within(inputs[real], a.window).mean())
    rows.append(dict(split=split.name, examples=int(real.sum()), within=fraction))
    print(f"| {split.name} | {int(real.sum())} | {fraction:.3f} |")
  return rows


if __name__ == "__main__":
  main()
