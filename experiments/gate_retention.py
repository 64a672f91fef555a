"""How much of the recurrent state a Gated DeltaNet keeps: per layer and head, the mean per-token decay exp(g)
and the fraction of what one token writes that survives a given number of tokens (a forgetting gate shows as
retention near 0 in every head).

Trained runs, from their newest checkpoints, on one MQAR batch (kept from token `--after` to the end):

  python -m experiments.gate_retention results/mqar_small/runs/gated_deltanet__d64__seed0__lr0.001 ...

A config's model at initialisation (`--seed`), on examples of its task's eval split `--split` (default the
first), kept over the `--distances` tokens that end at each example's first supervised position (the answer:
what a needle written that far before it keeps at the query):

  python -m experiments.gate_retention --config configs/niah.py --sweep-model gated_deltanet --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

from gdn.data import mqar
from gdn.layers import recurrent
from gdn.train import load_run


def _heads(values) -> str:
  return " ".join(f"{v:.3f}" for v in values)


def per_head(g) -> np.ndarray:
  """g [B, T, heads] (per-head decay) or [B, T, heads, K] (per key channel: the mean over K of the log decay,
  the geometric mean of the channels' decays) -> [B, T, heads]."""
  g = np.asarray(g, np.float64)
  return g.mean(-1) if g.ndim == 4 else g


def kept_before(g, ends, distance: int) -> np.ndarray:
  """Per head, the mean over examples of exp(sum of g over the `distance` tokens that end at ends[b]): what the
  token `distance` before position ends[b] wrote that is left there. g [B, T, heads]; ends [B]."""
  g = per_head(g)
  sums = [g[b, e - distance + 1:e + 1].sum(0) for b, e in enumerate(ends)]
  return np.exp(np.stack(sums)).mean(0)


def _record_decays():
  decays, original = [], recurrent.RecurrentMixer.log_decay

  def recorded(self, p, B, T):
    g = original(self, p, B, T)
    if g is not None:  # None: a mixer without a decay gate (DeltaNet)
      decays.append(np.asarray(g))
    return g

  recurrent.RecurrentMixer.log_decay = recorded
  return decays, lambda: setattr(recurrent.RecurrentMixer, "log_decay", original)


def trained_runs(args, decays):
  for run in args.runs:
    model, step, cfg = load_run(run)
    b = mqar.batch(cfg.data.mqar, np.random.default_rng(123), 64, cfg.data.mqar.eval_settings[0][0], args.pairs)
    decays.clear()
    hit = np.asarray(model(jnp.asarray(b["inputs"])).argmax(-1)) == b["targets"]
    print(f"{os.path.basename(run.rstrip('/'))}: step {step}, "
          f"accuracy on this batch {hit[b['weights'] > 0].mean():.3f}")
    for i, g in enumerate(decays):  # g: [B, T, heads]
      kept = np.exp(per_head(g)[:, args.after:].sum(1)).mean(0)
      print(f"  layer {i}: mean decay per token {_heads(np.exp(per_head(g)).mean((0, 1)))}, "
            f"kept from token {args.after} to the end {_heads(kept)}")


def at_init(args, decays):
  from flax import nnx

  from gdn.model import LanguageModel
  from gdn.train.config_file import resolve, sweep_model_overrides
  from gdn.train.loop import load_task

  distances = [int(d) for d in args.distances.split(",")]
  model_overrides = sweep_model_overrides(args.config, args.sweep_model)
  for seed in [int(s) for s in args.seeds.split(",")]:
    cfg = resolve(args.config, [*model_overrides, *args.override, f"seed={seed}"])
    task = load_task(cfg, log=lambda *a: None)  # a missing data file: a ConfigError naming its key
    names = [s.name for s in task.evals]
    if args.split and args.split not in names:
      raise SystemExit(f"--split {args.split!r} is not an eval split of the task; choose from {', '.join(names)}")
    split = task.evals[names.index(args.split)] if args.split else task.evals[0]
    b = split.make(np.random.default_rng(123), 0, args.examples)
    w = np.asarray(b["weights"]) > 0
    T = w.shape[1]
    ends = np.where(w.any(1), w.argmax(1), T - 1)  # the first supervised position, else the last
    model = LanguageModel(cfg.model, rngs=nnx.Rngs(seed))
    decays.clear()
    model(jnp.asarray(b["inputs"]))
    label = args.sweep_model or args.config
    print(f"{label}, seed {seed}, at initialisation: split {split.name}, {args.examples} examples of {T} tokens, "
          f"answer at position {ends.min()}-{ends.max()}")
    if not decays:
      print("  no decay gate: every head keeps all of the state")
    ds = [d for d in distances if d <= ends.min() + 1]  # windows that fit before every answer
    for i, g in enumerate(decays):
      kept = "; ".join(f"over {d}: {_heads(kept_before(g, ends, d))}" for d in ds)
      print(f"  layer {i}: mean decay per token {_heads(np.exp(per_head(g)).mean((0, 1)))}; kept {kept}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("runs", nargs="*", help="trained runs' directories (MQAR)")
  ap.add_argument("--after", type=int, default=8, help="runs: the position after the key-value pairs (2 x pairs)")
  ap.add_argument("--pairs", type=int, default=4, help="runs: key-value pairs of the MQAR batch")
  ap.add_argument("--config", help="a config file spec (FILE.py[:ARG]): its model at initialisation")
  ap.add_argument("--sweep-model", metavar="NAME", help="with --config: one model of its sweep.models")
  ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="with --config (repeatable)")
  ap.add_argument("--seeds", default="0", help="with --config: comma-separated initialisation seeds")
  ap.add_argument("--split", help="with --config: the eval split to read (default: the task's first)")
  ap.add_argument("--examples", type=int, default=16, help="with --config: examples of the split")
  ap.add_argument("--distances", default="16,64,256,1024", help="with --config: comma-separated token distances")
  args = ap.parse_args(argv)
  if bool(args.runs) == bool(args.config):
    ap.error("give either trained runs or --config")
  from gdn.train import ConfigError

  decays, restore = _record_decays()
  try:
    (at_init if args.config else trained_runs)(args, decays)
  except ConfigError as e:  # a bad config, sweep model or data file: its message, not a traceback
    raise SystemExit(f"gate_retention: {e}") from None
  finally:
    restore()


if __name__ == "__main__":
  main()
