"""State tracking: parity, modular arithmetic with and without brackets, S5 word problems.

Trained on short sequences and evaluated on longer ones (length generalisation), as in Grazzi et al. (2025)
and Merrill et al. (2024). Running tasks (parity, modular, s5) are supervised at every position with the
state of the prefix so far; "modular_brackets" (a fully bracketed expression, Deletang et al. 2023) only at
the final "=" with the value of the whole expression.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from gdn.data.pipeline import Split, check_settings

TASKS = ("parity", "modular", "modular_brackets", "s5")


@dataclasses.dataclass(frozen=True)
class StateConfig:
  task: str = "parity"
  modulus: int = 5  # modular arithmetic over Z_modulus with + - *
  train_length: int = 64
  eval_lengths: tuple = (64, 256, 512)
  eval_examples: int = 512  # per eval length

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
    check_settings("eval_lengths", tuple((t,) for t in self.eval_lengths), 1)
    if self.train_length < 2:
      raise ValueError(f"train_length must be >= 2, got {self.train_length}")
    if self.modulus < 2:
      raise ValueError(f"modulus must be >= 2, got {self.modulus}")


def vocab_size(cfg: StateConfig) -> int:
  m = cfg.modulus
  return {"parity": 2, "modular": m + 3, "modular_brackets": m + 7, "s5": 120}[cfg.task]


def chance(cfg: StateConfig) -> float:
  return 1.0 / {"parity": 2, "modular": cfg.modulus, "modular_brackets": cfg.modulus, "s5": 120}[cfg.task]


def _s5_table() -> np.ndarray:
  """table[a, b] = index of permutation a∘b (apply b, then a) over the 120 permutations of 5 items."""
  perms = list(itertools.permutations(range(5)))
  index = {p: i for i, p in enumerate(perms)}
  return np.array([[index[tuple(a[b[j]] for j in range(5))] for b in perms] for a in perms], np.int32)


_S5 = None


def _parity(rng, B, T):
  x = rng.integers(0, 2, size=(B, T))
  return x, np.cumsum(x, 1) % 2, np.ones((B, T), np.float32)


def _s5(rng, B, T):
  global _S5
  if _S5 is None:
    _S5 = _s5_table()
  x = rng.integers(0, 120, size=(B, T))
  y = np.empty_like(x)
  s = x[:, 0]
  y[:, 0] = s
  for t in range(1, T):
    s = _S5[x[:, t], s]
    y[:, t] = s
  return x, y, np.ones((B, T), np.float32)


def _modular(rng, B, T, m):
  """d op d op d ...; the target after each digit is the value so far, evaluated left to right."""
  x = np.empty((B, T), np.int64)
  y = np.zeros((B, T), np.int64)
  w = np.zeros((B, T), np.float32)
  digits = rng.integers(0, m, size=(B, (T + 1) // 2))
  ops = rng.integers(0, 3, size=(B, T // 2))
  x[:, 0::2] = digits
  x[:, 1::2] = m + ops
  s = digits[:, 0]
  y[:, 0], w[:, 0] = s, 1.0
  for i in range(1, digits.shape[1]):
    d, op = digits[:, i], ops[:, i - 1]
    s = np.where(op == 0, s + d, np.where(op == 1, s - d, s * d)) % m
    y[:, 2 * i], w[:, 2 * i] = s, 1.0
  return x, y, w


def _expression(rng, n, m):
  """A fully bracketed expression of exactly n tokens (n odd): (tokens, value mod m)."""
  if n == 1:
    d = int(rng.integers(m))
    return [d], d
  if n == 3:  # "(d)": the one length a binary node cannot fill
    d = int(rng.integers(m))
    return [m + 3, d, m + 4], d
  a = 1 + 2 * int(rng.integers((n - 3) // 2))  # odd length of the left operand; the right gets the rest
  left, lv = _expression(rng, a, m)
  right, rv = _expression(rng, n - 3 - a, m)
  op = int(rng.integers(3))
  value = (lv + rv, lv - rv, lv * rv)[op] % m
  return [m + 3] + left + [m + op] + right + [m + 4], value


def _brackets(rng, B, T, m):
  pad, eq = m + 6, m + 5
  n = T - 1 if (T - 1) % 2 else T - 2
  x = np.full((B, T), pad, np.int64)
  y = np.zeros((B, T), np.int64)
  w = np.zeros((B, T), np.float32)
  for b in range(B):
    tokens, value = _expression(rng, n, m)
    x[b, T - 1 - n:T - 1] = tokens  # left padding keeps the answer at the last position
    x[b, T - 1] = eq
    y[b, T - 1], w[b, T - 1] = value, 1.0
  return x, y, w


def batch(cfg: StateConfig, rng: np.random.Generator, batch_size: int, T: int) -> dict:
  if cfg.task == "parity":
    x, y, w = _parity(rng, batch_size, T)
  elif cfg.task == "s5":
    x, y, w = _s5(rng, batch_size, T)
  elif cfg.task == "modular":
    x, y, w = _modular(rng, batch_size, T, cfg.modulus)
  else:
    x, y, w = _brackets(rng, batch_size, T, cfg.modulus)
  return dict(inputs=x.astype(np.int32), targets=y.astype(np.int32), weights=w)


def train_batch(cfg: StateConfig, rng: np.random.Generator, batch_size: int) -> dict:
  return batch(cfg, rng, batch_size, cfg.train_length)


def eval_splits(cfg: StateConfig) -> list:
  return [Split(f"T{T}", cfg.eval_examples, lambda rng, start, n, T=T: batch(cfg, rng, n, T))
          for T in cfg.eval_lengths]
