"""Single needle in a haystack (S-NIAH, after RULER), in token space.

A haystack hides one needle `[NEEDLE] key... [SEP] value...` at a uniformly random depth; the sequence ends
with `[QUERY] key... [SEP] value...`, and the targets are the value tokens after the query (teacher forced).
Keys are "words" (tokens from the word range); RULER's three single-needle tasks (TASKS, or `tasks` for a
mixture of them) are:

  S-NIAH-1  haystack="repeat", value="number"  a filler phrase repeated; a number (digit tokens)
  S-NIAH-2  haystack="essay",  value="number"  windows of the run's fixed pseudo-essay; a number
  S-NIAH-3  haystack="essay",  value="uuid"    the same essay; a longer uuid (hex-digit tokens)

haystack="random" (i.i.d. tokens, a new haystack every example) is kept as an unstructured haystack.
Vocabulary: 0-3 markers, 4-13 digits, 4-19 hex digits (the digits and six letters), 20.. words.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from gdn.data.pipeline import Split, check_settings

PAD, NEEDLE, SEP, QUERY = 0, 1, 2, 3
_FIRST = 4  # first ordinary token
_DIGITS, _HEX = 10, 16  # the value alphabets start at _FIRST
_WORDS = _FIRST + _HEX  # first word token
_PHRASE = 24  # the longest repeated filler phrase
_ESSAY = 1 << 16  # length of the essay stream; windows of it are the haystacks
_SUCCESSORS = 8  # each essay token is followed by one of 8 tokens, so the essay has local structure like text
HAYSTACKS = ("repeat", "essay", "random")
VALUES = ("word", "number", "uuid")
TASKS = {"sniah1": ("repeat", "number"), "sniah2": ("essay", "number"), "sniah3": ("essay", "uuid")}


@dataclasses.dataclass(frozen=True)
class NIAHConfig:
  vocab_size: int = 512
  key_length: int = 4
  value_length: int = 4
  haystack: str = "repeat"  # one of HAYSTACKS
  value: str = "word"  # one of VALUES: any word token, digits, or hex digits
  # Names from TASKS: train on their mixture (one task per batch) and evaluate each, numbers with
  # value_length tokens and uuids with uuid_length; () trains and evaluates the one task set above.
  tasks: tuple = ()
  uuid_length: int = 8
  train_lengths: tuple = (1024,)
  eval_lengths: tuple = (1024, 2048, 4096, 8192)
  eval_examples: int = 256  # per eval length
  # Training loss weight of every position outside the answer (next-token prediction of the haystack, as a
  # language model is trained); the answer weighs 1, and evaluation counts only the answer.
  lm_weight: float = 0.0

  def __post_init__(self):
    if self.eval_examples < 1:
      raise ValueError(f"eval_examples must be >= 1, got {self.eval_examples}")
    if self.haystack not in HAYSTACKS:
      raise ValueError(f"haystack must be one of {HAYSTACKS}, got {self.haystack!r}")
    if self.value not in VALUES:
      raise ValueError(f"value must be one of {VALUES}, got {self.value!r}")
    bad = [t for t in self.tasks if t not in TASKS]
    if bad:
      raise ValueError(f"tasks must be names from {tuple(TASKS)}, got {bad}")
    for name in ("key_length", "value_length", "uuid_length"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
    check_settings("train_lengths", tuple((t,) for t in self.train_lengths), 1)
    check_settings("eval_lengths", tuple((t,) for t in self.eval_lengths), 1)
    needle = 2 * (self.key_length + max(self.value_length, self.uuid_length if self.tasks else 0) + 2)
    for T in self.train_lengths + self.eval_lengths:
      if T < needle + 8:
        raise ValueError(f"length {T} is too short for a needle and a query of {needle} tokens")
    if not 0.0 <= self.lm_weight <= 1.0:
      raise ValueError(f"lm_weight must be in [0, 1], got {self.lm_weight}")
    if self.vocab_size < _WORDS + 16:
      raise ValueError(f"vocab_size must be at least {_WORDS + 16}, got {self.vocab_size}")


def _values(cfg: NIAHConfig) -> tuple:
  """[low, high) of the value tokens."""
  return {"word": (_WORDS, cfg.vocab_size), "number": (_FIRST, _FIRST + _DIGITS),
          "uuid": (_FIRST, _FIRST + _HEX)}[cfg.value]


@functools.lru_cache(maxsize=8)
def essay(vocab_size: int, seed: int) -> np.ndarray:
  """The run's fixed pseudo-essay: a Markov chain over every ordinary token (digits included, as an essay has
  numbers) in which each token has _SUCCESSORS possible successors with Zipf-like weights. Like RULER's
  essays it is the same text in every example (different windows of it), predictable locally, and it never
  repeats a phrase for long, so a model cannot skip it as it can the repeated phrase."""
  rng = np.random.default_rng([seed, 11])
  succ = rng.integers(_FIRST, vocab_size, size=(vocab_size, _SUCCESSORS))
  p = 1.0 / np.arange(1, _SUCCESSORS + 1)
  pick = rng.choice(_SUCCESSORS, size=_ESSAY, p=p / p.sum())
  out = np.empty(_ESSAY, np.int64)
  tok = int(rng.integers(_FIRST, vocab_size))
  for i in range(_ESSAY):
    tok = out[i] = succ[tok, pick[i]]
  out.flags.writeable = False
  return out


def haystack(cfg: NIAHConfig, rng: np.random.Generator, B: int, T: int, seed: int) -> np.ndarray:
  if cfg.haystack == "repeat":
    # One phrase per example, of 8-24 tokens: the haystack holds no more than a phrase's worth of information,
    # as RULER's repeated sentences do, yet a model can neither learn the phrase by heart nor predict its
    # repeats from a fixed offset; under lm_weight, predicting them teaches in-context copying by content,
    # the circuit that retrieval needs.
    period = rng.integers(_PHRASE // 3, _PHRASE + 1, size=(B, 1))
    phrase = rng.integers(_FIRST, cfg.vocab_size, size=(B, _PHRASE))
    return np.take_along_axis(phrase, np.arange(T) % period, 1)
  if cfg.haystack == "essay":
    start = rng.integers(0, _ESSAY, size=(B, 1))
    return np.take(essay(cfg.vocab_size, seed), start + np.arange(T), mode="wrap")
  return rng.integers(_FIRST, cfg.vocab_size, size=(B, T))


def batch(cfg: NIAHConfig, rng: np.random.Generator, batch_size: int, T: int, seed: int,
          lm_weight: float = 0.0) -> dict:
  B, Kl, Vl = batch_size, cfg.key_length, cfg.value_length
  n = 2 + Kl + Vl  # marker, key, SEP, value
  hay = haystack(cfg, rng, B, T, seed)
  key = rng.integers(_WORDS, cfg.vocab_size, size=(B, Kl))
  value = rng.integers(*_values(cfg), size=(B, Vl))
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
  weights[:, :-1] = lm_weight  # the last position has no next token
  # The answer tokens are predicted from the SEP after the query key and from each earlier answer token.
  weights[:, T - Vl - 1:T - 1] = 1.0
  return dict(inputs=inputs.astype(np.int32), targets=targets.astype(np.int32), weights=weights)


def task(cfg: NIAHConfig, name: str) -> NIAHConfig:
  """The single task `name` of a mixture."""
  haystack_, value = TASKS[name]
  return dataclasses.replace(cfg, haystack=haystack_, value=value, tasks=(),
                             value_length=cfg.uuid_length if value == "uuid" else cfg.value_length)


def train_batch(cfg: NIAHConfig, rng: np.random.Generator, batch_size: int, seed: int) -> dict:
  if cfg.tasks:
    cfg = task(cfg, cfg.tasks[rng.integers(len(cfg.tasks))])
  T = cfg.train_lengths[rng.integers(len(cfg.train_lengths))]
  return batch(cfg, rng, batch_size, T, seed, cfg.lm_weight)


def eval_splits(cfg: NIAHConfig, seed: int) -> list:
  if cfg.tasks:
    return [Split(f"{name}_{s.name}", s.num_examples, s.make)
            for name in cfg.tasks for s in eval_splits(task(cfg, name), seed)]
  return [Split(f"T{T}", cfg.eval_examples, lambda rng, start, n, T=T: batch(cfg, rng, n, T, seed))
          for T in cfg.eval_lengths]
