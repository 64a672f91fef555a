"""A finished (or interrupted) training run's model, for evaluation, generation and export."""

from __future__ import annotations

import os

from flax import nnx

from gdn.model import LanguageModel
from gdn.train.checkpoint import Checkpoints
from gdn.train.config import ExperimentConfig, from_dict
from gdn.train.workdir import saved_config


def load_run(run_dir: str) -> tuple[LanguageModel, int, ExperimentConfig]:
  """(model, step, config) of the run in `run_dir` (the directory holding its config.json and checkpoints/):
  the model its config.json describes, with the parameters of its newest intact checkpoint (a damaged one is
  skipped with a warning), in the run's layout (scanned layers stay scanned: `gdn.model.unstack_layers` gives
  the layout of the interop writers, which also unstack by themselves). Raises FileNotFoundError naming what
  is missing."""
  saved = saved_config(run_dir)
  if saved is None:
    raise FileNotFoundError(f"run_dir {run_dir!r} has no config.json: not the directory of a training run")
  cfg = from_dict(saved)
  graphdef, params, rest = nnx.split(LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param, ...)
  ckpts = Checkpoints(os.path.join(run_dir, "checkpoints"), keep=1)
  try:
    params, step = ckpts.restore_params(params)
  finally:
    ckpts.close()
  return nnx.merge(graphdef, params, rest), step, cfg
