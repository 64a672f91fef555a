"""Train one config: `gdn-train --config configs/mqar.py:small [--config.model.d_model=128 ...]`.

Resumes automatically from the newest good checkpoint in the work directory (config.workdir, default
runs/<config.name>); config.train.resume chooses otherwise (docs/experiments.md). Exit status: 0 done,
2 a bad config, a config that the work directory's checkpoints do not fit, a missing data file or a work
directory that another run holds, 3 stopped by a non-finite loss or gradient.
"""

from __future__ import annotations

import os
import sys

import jax

from gdn.train import ConfigError, compile_cache, train
from gdn.train.checkpoint import ConfigMismatch, NoUsableCheckpoint
from gdn.train.config_file import resolve, split_argv
from gdn.train.loop import NonFiniteLoss
from gdn.train.workdir import WorkdirLocked

USAGE = ("usage: gdn-train --config FILE.py[:ARG] [--config.KEY=VALUE ...]\n"
         "  e.g. gdn-train --config configs/mqar.py:small --config.model.d_model=128 --config.workdir=runs/x")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(USAGE)
    return 0
  try:
    spec, overrides, rest = split_argv(argv)
    if rest or not spec:
      raise ConfigError(f"unexpected arguments {rest}" if rest else "--config is required")
    cfg = resolve(spec, overrides)
  except ConfigError as e:
    print(f"error: {e}\n{USAGE}", file=sys.stderr)
    return 2
  compile_cache.enable(cfg.compilation_cache, cfg.run_dir)
  try:
    summary = train(cfg)
  except (ConfigError, ConfigMismatch, NoUsableCheckpoint, WorkdirLocked) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except NonFiniteLoss as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  if jax.process_index() != 0:  # several hosts: one report
    return 0
  workdir = summary["workdir"]
  ev = summary["eval"]
  print(f"\n{cfg.name}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(ev.items()) if "/" not in k))
  print(f"config       {os.path.join(workdir, 'config.json')}")
  print(f"metrics      {os.path.join(workdir, 'metrics.jsonl')} (TensorBoard: tensorboard --logdir {workdir}/tb)")
  print(f"checkpoints  {os.path.join(workdir, 'checkpoints')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
