"""Typed training config and the whole experiment config (model, data, train, sweep).

`from_dict` is the one gate between a config dictionary (an ml_collections file plus command-line overrides)
and library code: it builds the frozen dataclasses and names the offending key when something is wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing

import jax

from gdn.config import ModelConfig
from gdn.data import DataConfig


class ConfigError(ValueError):
  """A config key is unknown or its value is bad; the message names the key."""


RESUME_MODES = ("auto", "fresh", "params_only")
MATMUL_PRECISIONS = ("", "float32", "tensorfloat32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 2000  # length of the learning-rate schedule
  stop_step: int = 0  # stop after this step while keeping the schedule of `steps` (0 = run all `steps`)
  # Stop at the first evaluation whose eval `early_stop_metric` (mean over splits) reaches `early_stop`
  # (0 = never); Zoology's MQAR runs stop at 0.99 validation accuracy.
  early_stop: float = 0.0
  early_stop_metric: str = "accuracy"
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1  # the cosine decays to learning_rate * min_lr_ratio
  weight_decay: float = 0.1
  decay_embeddings: bool = False
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0  # global norm; 0 = off
  # Positions of every row per application of the output head in the loss, recomputed in the backward (0 = all
  # at once): the [B, T, vocab] float32 logits and their gradient are then never held whole (gdn/train/step.py).
  loss_chunk: int = 0
  # The output head and the loss only at the positions that carry a weight: every row's supervised positions
  # (at most the task's `max_supervised`, e.g. MQAR's pairs) are gathered before the head, so the loss and its
  # gradient are the same and the head's FLOPs and logits shrink by T / max_supervised (16x for MQAR at
  # (256, 16)). Only for tasks that bound their supervised positions (gdn/train/step.py).
  supervised_head: bool = False
  log_every: int = 10
  eval_every: int = 500  # 0 = only at the end
  checkpoint_every: int = 500  # 0 = only at the end
  keep_checkpoints: int = 3
  progress_bar: bool = True
  mesh_data: int = -1  # data-parallel devices (-1: all that mesh_fsdp and mesh_seq leave); gdn/train/sharding.py
  mesh_fsdp: int = 1  # devices that split every parameter and its optimizer state (FSDP)
  mesh_seq: int = 1  # devices that split the time axis of every sequence (context parallelism; docs/scaling.md)
  # What a launch does with checkpoints in its work directory (gdn/train/workdir.py): "auto" continues them
  # if the config differs only in resumable keys; "fresh" sets the old run aside and starts again;
  # "params_only" sets it aside and starts again from its newest parameters (new optimizer, step 0).
  resume: str = "auto"
  skip_nonfinite: int = 0  # steps with a non-finite loss or gradient norm to skip before stopping (0: stop at one)
  # Precision of the float32 matmuls that name none (`jax.default_matmul_precision` around training and
  # evaluation): "" keeps the backend's default, which on recent NVIDIA GPUs rounds the operands to TF32 (and on
  # TPU to bfloat16 passes); "float32" computes them in float32, as PyTorch does by default
  # (torch.backends.cuda.matmul.allow_tf32 is False); "tensorfloat32" and "bfloat16" ask for those.
  matmul_precision: str = ""

  def __post_init__(self):
    for name in ("steps", "log_every", "keep_checkpoints"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name in ("stop_step", "warmup_steps", "eval_every", "checkpoint_every", "loss_chunk"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.mesh_fsdp < 1 or (self.mesh_data != -1 and self.mesh_data < 1):
      raise ValueError(f"mesh_fsdp must be >= 1 and mesh_data >= 1 or -1, got {self.mesh_fsdp}, {self.mesh_data}")
    if not isinstance(self.mesh_seq, int) or self.mesh_seq < 1:
      raise ValueError(f"mesh_seq must be a positive int, got {self.mesh_seq!r}")
    if self.resume not in RESUME_MODES:
      raise ValueError(f"resume must be one of {RESUME_MODES}, got {self.resume!r}")
    if not isinstance(self.skip_nonfinite, int) or self.skip_nonfinite < 0:
      raise ValueError(f"skip_nonfinite must be an int >= 0, got {self.skip_nonfinite!r}")
    if self.stop_step > self.steps:
      raise ValueError(f"stop_step {self.stop_step} is past steps {self.steps}")
    if self.warmup_steps >= self.steps:
      raise ValueError(f"warmup_steps {self.warmup_steps} must be smaller than steps {self.steps}")
    # Written as `not (...)` so that NaN, which fails every comparison, is refused too.
    for name in ("learning_rate", "eps"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    for name in ("weight_decay", "grad_clip"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
    if not self.early_stop >= 0:
      raise ValueError(f"early_stop must be >= 0, got {self.early_stop}")
    if self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}")

  @property
  def last_step(self) -> int:
    return self.stop_step or self.steps

  def precision(self):
    """The context that training and evaluation run in: `jax.default_matmul_precision`, or nothing for ""."""
    return jax.default_matmul_precision(self.matmul_precision) if self.matmul_precision else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """models x settings x seeds x learning rates. A model or setting is a tuple of "key=value" overrides."""
  models: dict = dataclasses.field(default_factory=dict)
  settings: dict = dataclasses.field(default_factory=dict)  # empty = one setting, the base config
  # "key=value" strings applied to every cell after its model's and setting's: a change to the whole grid that a
  # model's own overrides would undo if it were made on the base config (e.g. ("model.recurrent.norm_eps=1e-6",)
  # where a model's preset sets that key). Cells of other values belong under another config.name.
  overrides: tuple = ()
  seeds: tuple = (0,)
  learning_rates: tuple = ()  # empty = the base learning rate; else the best per cell is kept
  # The seeds that tune the rate: empty = every seed runs every rate and each keeps its best; else these seeds
  # run every rate, and the others only the rate with the best mean over these (per model and setting), once
  # all of these have finished (gdn.sweep.grid.tuned_rate); the report then takes every seed at that rate.
  tune_seeds: tuple = ()
  # With tune_seeds: up to this many rates added beyond an end of a (model, setting)'s grid, one at a time, each
  # where the tuning seeds' best rate so far is that end (the grid's own ratio at that end: 8e-3 after 4e-3,
  # 8e-3 gives 1.6e-2), so that no model's pick is cut off by the grid (gdn.sweep.grid.tuning_rates).
  extend_edges: int = 0
  metric: str = "accuracy"  # final eval metric that picks the learning rate and fills the table
  mode: str = "max"  # "max" | "min"
  x_key: str = ""  # a config key to plot the metric against (e.g. "model.d_model")
  # Published results to set beside ours in the report (gdn.sweep.published): name -> {"source", "metric",
  # "reference" (one of models), "values" {model: number}}, lower is better; or name -> {"source", "metric",
  # "by_split" {model: {eval split: value on our metric's scale}}}, set beside ours per split and in the length plot.
  published: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.mode not in ("max", "min"):
      raise ValueError(f"mode must be 'max' or 'min', got {self.mode!r}")
    for group in ("models", "settings"):
      for name, overrides in getattr(self, group).items():
        if isinstance(overrides, str) or any("=" not in o for o in overrides):
          raise ValueError(f"{group}.{name} must be a tuple of 'key=value' strings, got {overrides!r}")
    if isinstance(self.overrides, str) or any(not isinstance(o, str) or "=" not in o for o in self.overrides):
      raise ValueError(f"overrides must be a tuple of 'key=value' strings, got {self.overrides!r}")
    if not self.seeds:
      raise ValueError("seeds must not be empty")
    if isinstance(self.tune_seeds, (str, int)) or any(not isinstance(s, int) for s in self.tune_seeds):
      raise ValueError(f"tune_seeds must be a tuple of ints (seeds), got {self.tune_seeds!r}")
    if not isinstance(self.extend_edges, int) or self.extend_edges < 0:
      raise ValueError(f"extend_edges must be an int >= 0, got {self.extend_edges!r}")
    if self.extend_edges and not self.tune_seeds:
      raise ValueError("extend_edges needs tune_seeds: it widens the grid where the tuning seeds' best rate is at "
                       "its end (a grid of one rate has nothing to tune, and extend_edges does nothing there)")
    for name, spec in self.published.items():
      if "by_split" in spec:  # per-split numbers (model -> {eval split: value}) beside ours, no reference row
        missing = {"source", "metric"} - set(spec)
        if missing or any(not isinstance(v, dict) for v in spec["by_split"].values()):
          raise ValueError(f"published.{name} with by_split needs keys source and metric, and by_split as model -> "
                           f"{{eval split: value}}; got keys {sorted(spec)}")
        continue
      missing = {"source", "metric", "reference", "values"} - set(spec)
      if missing:
        raise ValueError(f"published.{name} needs keys source, metric, reference and values (or by_split); missing "
                         f"{', '.join(sorted(missing))}")
      if spec["reference"] not in spec["values"]:
        raise ValueError(f"published.{name}.reference {spec['reference']!r} has no value in its values")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str = "run"
  workdir: str = ""  # "" = runs/<name>
  seed: int = 0
  # XLA's persistent compilation cache (gdn/train/compile_cache.py), set by gdn-train and gdn-compare:
  # "auto" = .jax_cache beside the work directory (shared by a sweep's runs), "" = off, or a directory.
  compilation_cache: str = "auto"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  sweep: SweepConfig = SweepConfig()

  @property
  def run_dir(self) -> str:
    return self.workdir or f"runs/{self.name}"


def _build(cls, d, path: str):
  """cls(**d), recursing into dataclass-typed fields; errors name `path` and the key."""
  if not isinstance(d, dict):
    raise ConfigError(f"config.{path} must be a section, got {d!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ConfigError(f"unknown config key config.{path}.{unknown[0]} (known: {', '.join(sorted(fields))})")
  kwargs = {}
  for name, value in d.items():
    hint = hints[name]
    if isinstance(value, float) and not math.isfinite(value):  # no float key of any section means inf or NaN
      raise ConfigError(f"bad value for config.{path}.{name}: must be a finite number, got {value}")
    _check_type(hint, value, f"{path}.{name}")
    if dataclasses.is_dataclass(hint):
      kwargs[name] = _build(hint, value, f"{path}.{name}")
    elif hint is tuple and isinstance(value, list):
      kwargs[name] = _tuples(value)
    else:
      kwargs[name] = _tuples(value) if isinstance(value, tuple) else value
  try:
    return cls(**kwargs)
  except (ValueError, TypeError) as e:
    words = str(e).split()
    key = f"{path}.{words[0]}" if words and words[0] in fields else path
    raise ConfigError(f"bad value for config.{key}: {e}") from None


def _check_type(hint, value, key: str) -> None:
  """A scalar key's value against its annotation (int, float, str, bool, or one of them or None), so that an
  override such as num_v_heads=abc is named here rather than failing later inside a comparison."""
  options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
  if not all(t in (int, float, str, bool, type(None)) for t in options):
    return
  ok = (value is None and type(None) in options
        or isinstance(value, bool) and bool in options
        or not isinstance(value, bool) and (isinstance(value, int) and (int in options or float in options)
                                            or isinstance(value, float) and float in options
                                            or isinstance(value, str) and str in options))
  if not ok:
    names = " or ".join({int: "an int", float: "a number", str: "a string", bool: "a bool",
                         type(None): "None"}[t] for t in options)
    raise ConfigError(f"bad value for config.{key}: expects {names}, got {value!r}")


def _tuples(value):
  """Lists (as YAML round trips make them) back into the tuples that frozen configs hold."""
  if isinstance(value, (list, tuple)):
    return tuple(_tuples(v) for v in value)
  return value


def from_dict(d: dict) -> ExperimentConfig:
  """An ExperimentConfig from a plain nested dict (`ConfigDict.to_dict()`)."""
  d = dict(d)
  sweep = dict(d.pop("sweep", {}) or {})
  for group in ("models", "settings"):
    sweep[group] = {k: _tuples(v) for k, v in dict(sweep.get(group, {}) or {}).items()}
  d["sweep"] = sweep
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(ExperimentConfig)})
  if unknown:
    raise ConfigError(f"unknown config key config.{unknown[0]}")
  hints = typing.get_type_hints(ExperimentConfig)
  kwargs = {}
  for name, value in d.items():
    kwargs[name] = _build(hints[name], value, name) if dataclasses.is_dataclass(hints[name]) else value
  cfg = ExperimentConfig(**kwargs)
  if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:
    raise ConfigError(f"config.seed must be an int >= 0 (it seeds NumPy's generators too), got {cfg.seed!r}")
  if not isinstance(cfg.name, str) or not cfg.name:
    raise ConfigError(f"config.name must be a non-empty string (it names the run and its directory), got "
                      f"{cfg.name!r}")
  _check_context_parallel(cfg)
  return cfg


def _check_context_parallel(cfg: ExperimentConfig) -> None:
  """What context parallelism (train.mesh_seq > 1) declines, refused when the config is read rather than when
  the first step is traced. The device count and the sequence lengths are checked by the loop and the step."""
  if cfg.train.mesh_seq == 1:
    return
  for kind, key in (("recurrent", "recurrent"), ("mamba2", "mamba2")):
    rec = cfg.model.mixer_config(kind)
    if kind == "mamba2" and kind not in cfg.model.layer_kinds:
      continue
    if rec.dropout > 0:
      raise ConfigError(f"config.train.mesh_seq={cfg.train.mesh_seq} does not support "
                        f"config.model.{key}.dropout={rec.dropout}: every device would draw its slice's "
                        "dropout mask from the same key; set dropout to 0 or mesh_seq to 1")
    if kind in cfg.model.layer_kinds and rec.beta == "channel":
      raise ConfigError(f"config.train.mesh_seq={cfg.train.mesh_seq} does not support "
                        f"config.model.{key}.beta='channel' (per-value-channel beta has no [K, K] slice "
                        "map); use beta='head' or mesh_seq=1")


def to_dict(cfg) -> dict:
  """The nested dict of a dataclass config, the inverse of `from_dict` (tuples stay tuples)."""
  return dataclasses.asdict(cfg)
