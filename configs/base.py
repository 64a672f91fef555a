"""The base config: every key any run reads, at its default (the fields of gdn.train.ExperimentConfig).

Experiment files call `get_config()` here and change a few fields; `mixer()` and `width()` spell common model
changes as "key=value" overrides, the form sweeps and the command line share.
"""

import copy
import dataclasses

from gdn.bench.model_flops import param_count
from gdn.config import PRESETS, RecurrentConfig
from gdn.param_match import matched_mlp_hidden
from gdn.train.config import ConfigError, from_dict
from gdn.train.config_file import apply_overrides, base_config

MIXERS = ("attention", "linear_attention", "gla_mamba2", "deltanet", "gated_deltanet", "kda")


def get_config():
  return base_config()


def task(c, name: str, *, batch_size: int, vocab_size: int, num_layers: int, metric: str = "accuracy",
         mode: str = "max"):
  """The preamble of a task config: the task, its batch, one vocabulary for the model and the task (MQAR and
  NIAH draw tokens from data.<task>.vocab_size; the other tasks fix theirs), depth and the sweep's metric."""
  c.data.task = name
  c.data.batch_size = batch_size
  c.model.vocab_size = vocab_size
  if name in ("mqar", "niah"):
    c.data[name].vocab_size = vocab_size
  c.model.num_layers = num_layers
  c.sweep.metric = metric
  c.sweep.mode = mode
  return c


def vocab(v: int, task: str = "mqar") -> tuple:
  """Overrides for one vocabulary size in the model and the task together."""
  return (f"model.vocab_size={v}", f"data.{task}.vocab_size={v}")


def schedule(c, steps: int, warmup: int, *, every: int, learning_rate=None):
  """`steps` with `warmup` warmup steps, evaluating and checkpointing every `every` steps."""
  c.train.steps, c.train.warmup_steps = steps, warmup
  c.train.eval_every = c.train.checkpoint_every = every
  if learning_rate is not None:
    c.train.learning_rate = learning_rate
  return c


def cpu(c):
  """The token scan for the small CPU versions: it compiles faster on CPU than the chunked form."""
  c.model.recurrent.method = "recurrent"
  return c


def _text(v) -> str:
  return str(v).lower() if isinstance(v, bool) else str(v)


TUNABLE = frozenset({"norm_eps"})


def mixer(name: str, pattern: str = "R", **overrides) -> tuple:
  """Overrides selecting a mixer: "attention", or a recurrent preset of gdn.config.PRESETS in `pattern`.

  Every switch that some preset sets (and allow_neg_eigval) is spelled out, at its RecurrentConfig default
  unless the preset or `overrides` change it, so the result does not depend on the config it is applied to.
  A hyperparameter that a preset sets (TUNABLE: the output norm's eps of `mamba2`) is spelled out only for that
  preset, so that `--config.model.recurrent.norm_eps` still reaches the others (for every cell:
  `config.sweep.overrides`).
  """
  if name == "attention":
    return ("model.pattern=A",)
  if name not in PRESETS:
    raise ConfigError(f"unknown mixer {name!r}; choose from attention, {', '.join(sorted(PRESETS))}")
  defaults = dataclasses.asdict(RecurrentConfig())
  switches = sorted(({k for p in PRESETS.values() for k in p} - TUNABLE) | {"allow_neg_eigval"})
  fields = {**{k: defaults[k] for k in switches}, **PRESETS[name], **overrides}
  return (f"model.pattern={pattern}",) + tuple(f"model.recurrent.{k}={_text(v)}" for k, v in fields.items())


def width(d_model: int, num_heads: int = 2) -> tuple:
  """d_model with recurrent and attention heads splitting it evenly."""
  return (f"model.d_model={d_model}", f"model.recurrent.num_heads={num_heads}",
          f"model.recurrent.head_dim={d_model // num_heads}", f"model.attention.num_heads={num_heads}",
          f"model.attention.head_dim={d_model // num_heads}")


def byte_lm(c, name: str, size: str, num_layers: int):
  """The byte-level language-modelling setup that the block ablations and the hybrid ratios share: the
  full run (4 x 512-byte sequences x 32, 5000 steps) or its small CPU version (128 bytes x 16, 200 steps)."""
  c.name = name if size == "full" else f"{name}_small"
  task(c, "bytes", batch_size=32 if size == "full" else 16, vocab_size=256, num_layers=num_layers,
       metric="bits_per_byte", mode="min")
  c.data.eval_batch_size = 32
  c.data.text.seq_len = c.data.text.eval_examples = 512 if size == "full" else 128
  if size == "full":
    schedule(c, 5000, 250, every=1000, learning_rate=1e-3)
  else:
    schedule(cpu(c), 200, 20, every=200, learning_rate=3e-3)
  return c


# The corpus of gdn.data.corpus: "full" is every .py of the stdlib and site-packages (316 MB on the CPU machine,
# 2026-12-01), "small" the stdlib capped at 4 MB for the CPU versions and tests. Both are built by one command:
CORPUS = {"full": ("data/pycode", "python -m gdn.data.corpus --out data/pycode"),
          "small": ("data/pycode_small", "python -m gdn.data.corpus --out data/pycode_small --roots stdlib "
                                         "--max-bytes 4000000")}


def pycode_lm(c, name: str, size: str, num_layers: int):
  """Language modelling on the gdn-corpus files, every training token seen at most once (data.text.single_pass
  refuses a longer run): the full run (64 x 512 bytes x 2,000 steps = 65.5M bytes; seed 0 at 5 rates from 5e-4
  to 8e-3, seeds 1 and 2 at the one it picked), or its small CPU version (16 x 128 bytes x 150 steps, one seed
  and rate). data.text.{train,val}_file name the corpus."""
  c.name = name if size == "full" else f"{name}_small"
  full = size == "full"
  task(c, "tokens", batch_size=64 if full else 16, vocab_size=256, num_layers=num_layers,
       metric="bits_per_byte", mode="min")
  out = CORPUS[size][0]
  t = c.data.text
  t.train_file, t.val_file = f"{out}/train.bin", f"{out}/val.bin"
  t.token_dtype, t.vocab_size, t.single_pass = "uint8", 256, True
  t.seq_len = 512 if full else 128
  t.eval_examples = 1024 if full else 128
  c.data.eval_batch_size = 64 if full else 32
  if full:
    schedule(c, 2000, 200, every=500, learning_rate=2e-3)
    c.model.dtype = "bfloat16"
    c.sweep.seeds, c.sweep.learning_rates = (0, 1, 2), (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
    c.sweep.tune_seeds = (0,)  # seed 0 runs every rate; seeds 1 and 2 the one it picked
    c.sweep.extend_edges = 1  # one rate beyond the grid's end where seed 0 is best there
  else:
    schedule(cpu(c), 150, 15, every=150, learning_rate=3e-3)
    c.sweep.seeds, c.sweep.learning_rates = (0,), (3e-3,)
  return c


def model_config(c, overrides=()):
  """The ModelConfig that `c` with `overrides` trains."""
  return from_dict(apply(copy.deepcopy(c), overrides).to_dict()).model


def matched(c, models: dict, reference: str) -> dict:
  """`models` with model.mlp_hidden set so that each has (nearly) the parameters of `models[reference]`
  (gdn.param_match: the dense MLP width is the free knob; rounding to 8 keeps them within 0.5%)."""
  target = param_count(model_config(c, models[reference]))
  return {name: tuple(o) + (f"model.mlp_hidden={matched_mlp_hidden(model_config(c, o), target)}",)
          for name, o in models.items()}


def check_size(size: str) -> str:
  if size not in ("full", "small"):
    raise ConfigError(f"config argument must be 'full' or 'small' (e.g. configs/mqar.py:small), got {size!r}")
  return size


def apply(config, overrides):
  """Applies "key=value" overrides to a config (the same parser as the command line)."""
  return apply_overrides(config, overrides)
