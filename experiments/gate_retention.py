"""How much of the recurrent state a trained Gated DeltaNet keeps: per layer and head, the mean per-token decay
exp(g) and the fraction of what was written by token `--after` that survives to the end of the sequence,
from a run's newest checkpoint, on one MQAR batch of its task (a forgetting gate shows as retention near 0
in every head).

  python -m experiments.gate_retention results/mqar_small/runs/gated_deltanet__d64__seed0__lr0.001 ...
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("runs", nargs="+")
  ap.add_argument("--after", type=int, default=8, help="the position after the key-value pairs (2 x pairs)")
  ap.add_argument("--pairs", type=int, default=4)
  args = ap.parse_args(argv)
  decays = []
  original = recurrent.RecurrentMixer.log_decay

  def recorded(self, p, B, T):
    g = original(self, p, B, T)
    decays.append(np.asarray(g))
    return g

  recurrent.RecurrentMixer.log_decay = recorded
  try:
    for run in args.runs:
      model, step, cfg = load_run(run)
      b = mqar.batch(cfg.data.mqar, np.random.default_rng(123), 64, cfg.data.mqar.eval_settings[0][0], args.pairs)
      decays.clear()
      hit = np.asarray(model(jnp.asarray(b["inputs"])).argmax(-1)) == b["targets"]
      print(f"{os.path.basename(run.rstrip('/'))}: step {step}, accuracy on this batch {hit[b['weights'] > 0].mean():.3f}")
      for i, g in enumerate(decays):  # g: [B, T, heads]
        kept = np.exp(g[:, args.after:].sum(1)).mean(0)
        print(f"  layer {i}: mean decay per token {_heads(np.exp(g).mean((0, 1)))}, "
              f"kept from token {args.after} to the end {_heads(kept)}")
  finally:
    recurrent.RecurrentMixer.log_decay = original


if __name__ == "__main__":
  main()
