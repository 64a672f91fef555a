"""Single needle in a haystack (S-NIAH, after RULER), in token space.

A haystack of filler tokens hides one needle `[NEEDLE] key... [SEP] value...` at a uniformly random depth;
the sequence ends with `[QUERY] key... [SEP] value...`, and the targets are the value tokens after the
query (teacher forced). haystack="repeat" is RULER's S-NIAH-1 (one fixed filler phrase repeated),
"random" its S-NIAH-2 flavour (distractor tokens drawn from the key/value vocabulary).
Train at short lengths, evaluate at 1K-8K.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gdn.data.pipeline import Split, check_settings

PAD, NEEDLE, SEP, QUERY = 0, 1, 2, 3
_FIRST = 4  # first ordinary token
_PHRASE = 24  # length of the repeated filler phrase


@dataclasses.dataclass(frozen=True)
class NIAHConfig:
  vocab_size: int = 512
  key_length: int = 4
  value_length: int = 4
  haystack: str = "repeat"  # "repeat" | "random"
  train_lengths: tuple = (1024,)
  eval_lengths: tuple = (1024, 2048, 4096, 8192)
  eval_examples: int = 256  # per eval length

  def __post_init__(self):
    if self.haystack not in ("repeat", "random"):
      raise ValueError(f"haystack must be 'repeat' or 'random', got {self.haystack!r}")
    check_settings("train_lengths", tuple((t,) for t in self.train_lengths), 1)
    check_settings("eval_lengths", tuple((t,) for t in self.eval_lengths), 1)
    needle = 2 * (self.key_length + self.value_length + 2)
    for T in self.train_lengths + self.eval_lengths:
      if T < needle + 8:
        raise ValueError(f"length {T} is too short for a needle and a query of {needle} tokens")
    if self.vocab_size < _FIRST + 16:
      raise ValueError(f"vocab_size must be at least {_FIRST + 16}, got {self.vocab_size}")


def batch(cfg: NIAHConfig, rng: np.random.Generator, batch_size: int, T: int, seed: int) -> dict:
  B, Kl, Vl = batch_size, cfg.key_length, cfg.value_length
  n = 2 + Kl + Vl  # marker, key, SEP, value
  if cfg.haystack == "repeat":
    # The phrase is fixed per run (seeded by the run's seed), as a real haystack's text would be.
    phrase = np.random.default_rng([seed, 7]).integers(_FIRST, cfg.vocab_size, _PHRASE)
    hay = np.tile(phrase, T // _PHRASE + 1)[None, :T].repeat(B, 0)
  else:
    hay = rng.integers(_FIRST, cfg.vocab_size, size=(B, T))
  key = rng.integers(_FIRST, cfg.vocab_size, size=(B, Kl))
  value = rng.integers(_FIRST, cfg.vocab_size, size=(B, Vl))
  needle = np.concatenate([np.full((B, 1), NEEDLE), key, np.full((B, 1), SEP), value], 1)
  query = np.concatenate([np.full((B, 1), QUERY), key, np.full((B, 1), SEP), value], 1)

  seq = hay.copy()
  haystack_len = T - n  # the query closes the sequence
  depth = rng.integers(0, haystack_len - n + 1, size=B)
  rows = np.arange(B)[:, None]
  seq[rows, depth[:, None] + np.arange(n)] = needle
  seq[:, haystack_len:] = query
  inputs = seq
  targets = np.zeros((B, T), np.int64)
  targets[:, :-1] = seq[:, 1:]
  weights = np.zeros((B, T), np.float32)
  # The answer tokens are predicted from the SEP after the query key and from each earlier answer token.
  weights[:, T - Vl - 1:T - 1] = 1.0
  return dict(inputs=inputs.astype(np.int32), targets=targets.astype(np.int32), weights=weights)


def train_batch(cfg: NIAHConfig, rng: np.random.Generator, batch_size: int, seed: int) -> dict:
  T = cfg.train_lengths[rng.integers(len(cfg.train_lengths))]
  return batch(cfg, rng, batch_size, T, seed)


def eval_splits(cfg: NIAHConfig, seed: int) -> list:
  return [Split(f"T{T}", cfg.eval_examples, lambda rng, start, n, T=T: batch(cfg, rng, n, T, seed))
          for T in cfg.eval_lengths]
