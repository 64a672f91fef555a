"""Host time to make a config's training batches, per sweep setting: what a step waits for when the data is slower
than the device.

A task's batch i is drawn on the host (`gdn.data.pipeline`: grain, prefetched by a thread), and a stacked group
(`gdn-compare --stack`) draws one batch per data stream and step (its cells of one seed share one:
`gdn.train.stacked.shared_iterators`). Python threads share one interpreter lock, so a group of N streams needs
about N times one batch's time per step, whatever the device does. This prints, per setting of the config's
sweep (each setting's overrides applied; the sweep's first model), the median milliseconds to make one batch
(`task.train[i]` for `--batches` consecutive i after a warm-up) and that times `--cells` (the streams).

  python -m experiments.bench_data --config configs/state_tracking.py --cells 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from gdn.sweep import expand
from gdn.train.config_file import apply_overrides, load, split_argv
from gdn.train.loop import load_task


def batch_ms(cfg, batches: int) -> float:
  """The median ms to make one of the first `batches` training batches of cfg's task (after one untimed)."""
  train = load_task(cfg, log=lambda *_: None).train
  train[0]
  times = []
  for i in range(1, batches + 1):
    t0 = time.perf_counter()
    train[i]
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def main(argv=None) -> list:
  spec, overrides, rest = split_argv(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(prog="python -m experiments.bench_data",
                              usage="python -m experiments.bench_data --config FILE.py[:ARG] "
                                    "[--config.KEY=VALUE ...] [options]",
                              description=__doc__.split("\n")[0])
  p.add_argument("--batches", type=int, default=20, help="batches timed per setting")
  p.add_argument("--cells", type=int, default=12,
                 help="data streams of a stacked group (its seeds, or cells before they shared), for the per-step "
                 "column")
  a = p.parse_args(rest)
  if not spec:
    p.error("--config is required")
  config = apply_overrides(load(spec), overrides)
  cells = expand(config)
  first = {}
  for c in cells:  # one cell per setting: the sweep's first model, seed and rate
    first.setdefault(c.setting, c)
  print(f"# host time per training batch, {spec}: batch size {config.data.batch_size}, median of {a.batches}")
  print(f"| setting | ms a batch | ms a step of {a.cells} stacked cells |")
  print("|---|---:|---:|")
  rows = []
  for setting, c in first.items():
    ms = batch_ms(c.config, a.batches)
    rows.append(dict(setting=setting, ms=ms))
    print(f"| {setting} | {ms:.2f} | {a.cells * ms:.1f} |", flush=True)
  return rows


if __name__ == "__main__":
  main()
