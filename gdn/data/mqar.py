"""Multi-query associative recall (MQAR) as in Zoology (Arora et al., 2023).

A sequence is `num_pairs` key-value pairs followed by a query region in which each key appears once more,
at a gap from the region's start drawn from a power law; the target after each query key is its value.
Keys come from the lower half of the vocabulary and values from the upper half, both without repetition
inside an example; every other query-region position is a random token (Zoology's `random_non_queries`).
Shapes: B batch, T sequence length, P key-value pairs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gdn.data.pipeline import Split, check_settings

SETTINGS = ((64, 4), (128, 8), (256, 16), (512, 64))


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  vocab_size: int = 8192
  train_settings: tuple = SETTINGS  # (sequence length, key-value pairs); each batch draws one setting
  eval_settings: tuple = SETTINGS
  power_a: float = 0.01  # power-law exponent of the query gaps (1.0 = uniform), Zoology's default
  random_non_queries: bool = True
  eval_examples: int = 1000  # per eval setting

  def __post_init__(self):
    if self.eval_examples < 1:
      raise ValueError(f"eval_examples must be >= 1, got {self.eval_examples}")
    for name in ("train_settings", "eval_settings"):
      for T, P in check_settings(name, getattr(self, name), 2):
        if T % 2 or 4 * P > T:
          raise ValueError(f"{name}: length {T} must be even and hold 4 * pairs ({P}) tokens")
        if self.vocab_size // 2 <= P:
          raise ValueError(f"vocab_size {self.vocab_size} is too small for {P} distinct keys and values")
    if not 0.0 < self.power_a <= 1.0:
      raise ValueError(f"power_a must be in (0, 1], got {self.power_a}")


def _distinct(rng, low, high, B, P):
  """[B, P] integers in [low, high), distinct within each row (resampling the rare rows with a repeat)."""
  out = rng.integers(low, high, size=(B, P))
  while True:
    s = np.sort(out, axis=1)
    bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0]
    if not len(bad):
      return out
    out[bad] = rng.integers(low, high, size=(len(bad), P))


def _power_law_gaps(rng, space, a, B, P):
  """P distinct gaps in [0, space) per row, drawn successively with p(r) ~ a * r^(a - 1) (Gumbel top-k)."""
  r = np.arange(1, space + 1)
  scores = np.log(a) + (a - 1) * np.log(r) + rng.gumbel(size=(B, space))
  return np.argpartition(-scores, P - 1, axis=1)[:, :P]


def batch(cfg: MQARConfig, rng: np.random.Generator, batch_size: int, T: int, P: int) -> dict:
  B, C = batch_size, 2 * P
  half = cfg.vocab_size // 2
  keys_BxP = _distinct(rng, 1, half, B, P)
  values_BxP = _distinct(rng, half, cfg.vocab_size, B, P)
  gaps_BxP = _power_law_gaps(rng, (T - C) // 2, cfg.power_a, B, P)

  seq = np.zeros((B, T + 1), np.int64)
  seq[:, 0:C:2] = keys_BxP
  seq[:, 1:C:2] = values_BxP
  rows = np.arange(B)[:, None]
  seq[rows, C + 2 * gaps_BxP] = keys_BxP
  targets = np.zeros((B, T + 1), np.int64)
  weights = np.zeros((B, T + 1), np.float32)
  # The value is predicted at the query key's position, i.e. it is the next token after the key.
  targets[rows, C + 2 * gaps_BxP] = values_BxP
  weights[rows, C + 2 * gaps_BxP] = 1.0
  inputs = seq[:, :T]
  if cfg.random_non_queries:
    region = np.zeros((B, T), bool)
    region[:, C:] = True
    region[rows, C + 2 * gaps_BxP] = False
    inputs = np.where(region, rng.integers(0, cfg.vocab_size, size=(B, T)), inputs)
  return dict(inputs=inputs.astype(np.int32), targets=targets[:, :T].astype(np.int32),
              weights=weights[:, :T])


def train_batch(cfg: MQARConfig, rng: np.random.Generator, batch_size: int) -> dict:
  T, P = cfg.train_settings[rng.integers(len(cfg.train_settings))]
  return batch(cfg, rng, batch_size, T, P)


def eval_splits(cfg: MQARConfig) -> list:
  return [Split(f"T{T}_P{P}", cfg.eval_examples, lambda rng, start, n, T=T, P=P: batch(cfg, rng, n, T, P))
          for T, P in cfg.eval_settings]
