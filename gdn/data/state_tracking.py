"""State tracking as Grazzi et al. (2025, section 5.1 and appendix E.1) set it up: parity and modular
arithmetic with and without brackets (Deletang et al. 2023, through xLSTM's generators), plus S5 word problems
(Merrill et al. 2024).

Every example draws its own length L from `train_lengths` (min, max) and is right-padded to max, so a batch
has one shape; the eval splits hold examples of exactly one length each (T40 ... T256). L counts the tokens of
the authors' sequence, answer included; the model reads the tokens before the answer and is supervised only
where the answer is predicted:
- parity: L - 1 random bits; the target at the last bit is their parity.
- modular: `d op d op ... d =` over Z_modulus with + - *, evaluated with precedence (* before + and -), the
  value as the target at "="; L odd (an even L gives L - 1, as their generator does).
- modular_brackets: a random bracketed expression of L - 3 tokens (unary minus included), "=", the value at
  "=" (L is at least 5, as theirs).
- s5: L permutations of 5 items; supervised at every position with the product so far.
Padding (a token of its own) follows the example and carries no weight; the models are causal, so it cannot
change a prediction.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from gdn.data.pipeline import Split

TASKS = ("parity", "modular", "modular_brackets", "s5")


@dataclasses.dataclass(frozen=True)
class StateConfig:
  task: str = "parity"
  modulus: int = 5  # modular arithmetic over Z_modulus with + - *
  train_lengths: tuple = (3, 40)  # (min, max): each training example draws its length uniformly from these
  eval_lengths: tuple = (40, 64, 88, 112, 136, 160, 184, 208, 232, 256)
  eval_examples: int = 512  # per eval length

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
    if self.modulus < 2:
      raise ValueError(f"modulus must be >= 2, got {self.modulus}")
    lo = 5 if self.task == "modular_brackets" else 3  # shorter leaves no room for an expression and its "="
    t = self.train_lengths
    if not (isinstance(t, tuple) and len(t) == 2 and all(isinstance(x, int) for x in t) and 3 <= t[0] <= t[1]
            and t[1] >= lo):
      raise ValueError(f"train_lengths must be (min, max) with 3 <= min <= max and max >= {lo} for "
                       f"{self.task}, got {t!r}")
    e = self.eval_lengths
    if not (isinstance(e, tuple) and e and all(isinstance(x, int) and x >= lo for x in e)):
      raise ValueError(f"eval_lengths must be a non-empty tuple of ints >= {lo} for {self.task}, got {e!r}")
    if self.eval_examples < 1:
      raise ValueError(f"eval_examples must be >= 1, got {self.eval_examples}")


def vocab_size(cfg: StateConfig) -> int:
  m = cfg.modulus
  return {"parity": 3, "modular": m + 5, "modular_brackets": m + 7, "s5": 121}[cfg.task]


def chance(cfg: StateConfig) -> float:
  return 1.0 / {"parity": 2, "modular": cfg.modulus, "modular_brackets": cfg.modulus, "s5": 120}[cfg.task]


def _s5_table() -> np.ndarray:
  """table[a, b] = index of permutation a∘b (apply b, then a) over the 120 permutations of 5 items."""
  perms = list(itertools.permutations(range(5)))
  index = {p: i for i, p in enumerate(perms)}
  return np.array([[index[tuple(a[b[j]] for j in range(5))] for b in perms] for a in perms], np.int32)


_S5 = None


def _parity(rng, L, W):
  B = len(L)
  n = L - 1  # bits read; the answer would be token L
  pos = np.arange(W)[None]
  bits = rng.integers(0, 2, size=(B, W))
  x = np.where(pos < n[:, None], bits, 2)
  y, w = np.zeros((B, W), np.int64), np.zeros((B, W), np.float32)
  rows = np.arange(B)
  y[rows, n - 1] = (x == 1).sum(1) % 2
  w[rows, n - 1] = 1.0
  return x, y, w


def _modular(rng, L, W, m):
  """d op d ... d = with + - * evaluated with precedence: a sum of signed products, folded left to right."""
  B = len(L)
  minus, times, eq, pad = m + 1, m + 2, m + 3, m + 4
  k = (L - 1 + L % 2) // 2  # numbers: an odd length s = 2k + 1 holds k numbers, "=" and the answer
  K = int(k.max())
  digits = rng.integers(0, m, size=(B, K))
  ops = rng.integers(0, 3, size=(B, max(K - 1, 1))) + m
  x = np.full((B, W), pad, np.int64)
  x[:, 0:2 * K - 1:2] = digits
  x[:, 1:2 * K - 2:2] = ops[:, :K - 1]
  rows = np.arange(B)
  x[np.arange(W)[None] >= 2 * k[:, None]] = pad
  x[rows, 2 * k - 1] = eq
  total, term, sign = np.zeros(B, np.int64), digits[:, 0].astype(np.int64), np.ones(B, np.int64)
  for i in range(1, K):
    on, op, d = i < k, ops[:, i - 1], digits[:, i]
    mul = on & (op == times)
    new = on & ~mul
    total = np.where(new, (total + sign * term) % m, total)
    sign = np.where(new, np.where(op == minus, -1, 1), sign)
    term = np.where(mul, term * d % m, np.where(new, d, term))
  y, w = np.zeros((B, W), np.int64), np.zeros((B, W), np.float32)
  y[rows, 2 * k - 1] = (total + sign * term) % m
  w[rows, 2 * k - 1] = 1.0
  return x, y, w


def _emit(u, n: int, m: int, out: list) -> int:
  """Appends a random expression of exactly n tokens to `out` and returns its value mod m, drawn as xLSTM's
  generator for Grazzi et al. draws it: below 5 tokens d, -d, (d), (-d); else (left op right) with the left's
  length uniform in [1, n - 4] and op uniform in +, -, *. The draws are the next values of `u`, an iterator of
  uniforms in [0, 1) (one array a batch, drawn by `_brackets`: numpy's per-call cost was most of the time)."""
  plus, minus, open_, close = m, m + 1, m + 3, m + 4
  if n < 5:
    d = int(next(u) * m)
    if n >= 3:
      out.append(open_)
    if n % 2 == 0:
      out.append(minus)
    out.append(d)
    if n >= 3:
      out.append(close)
    return -d % m if n % 2 == 0 else d
  a = 1 + int(next(u) * (n - 4))
  op = int(next(u) * 3)
  out.append(open_)
  lv = _emit(u, a, m, out)
  out.append(plus + op)
  rv = _emit(u, n - 3 - a, m, out)
  out.append(close)
  return (lv + rv, lv - rv, lv * rv)[op] % m


def _brackets(rng, L, W, m):
  B = len(L)
  eq, pad = m + 5, m + 6
  x = np.full((B, W), pad, np.int64)
  y, w = np.zeros((B, W), np.int64), np.zeros((B, W), np.float32)
  # An expression of n <= W - 3 tokens has at most W / 4 leaves, so at most 3 W / 4 - 2 draws.
  draws = rng.random((B, 3 * (W // 4) + 1)).tolist()
  for b in range(B):
    n = max(int(L[b]), 5) - 3
    tokens = []
    value = _emit(iter(draws[b]), n, m, tokens)
    x[b, :n] = tokens
    x[b, n] = eq
    y[b, n], w[b, n] = value, 1.0
  return x, y, w


def _s5(rng, L, W):
  global _S5
  if _S5 is None:
    _S5 = _s5_table()
  B = len(L)
  x = rng.integers(0, 120, size=(B, W))
  y = np.empty_like(x)
  s = x[:, 0]
  y[:, 0] = s
  for t in range(1, W):
    s = _S5[x[:, t], s]
    y[:, t] = s
  on = np.arange(W)[None] < L[:, None]
  return np.where(on, x, 120), np.where(on, y, 0), on.astype(np.float32)


def batch(cfg: StateConfig, rng: np.random.Generator, batch_size: int, T: int, lo=None) -> dict:
  """`batch_size` examples of lengths drawn uniformly from [lo, T] (lo None: all of length T), width T."""
  L = np.full(batch_size, T) if lo is None else rng.integers(lo, T + 1, size=batch_size)
  if cfg.task == "parity":
    x, y, w = _parity(rng, L, T)
  elif cfg.task == "modular":
    x, y, w = _modular(rng, L, T, cfg.modulus)
  elif cfg.task == "modular_brackets":
    x, y, w = _brackets(rng, L, T, cfg.modulus)
  else:
    x, y, w = _s5(rng, L, T)
  return dict(inputs=x.astype(np.int32), targets=y.astype(np.int32), weights=w)


def train_batch(cfg: StateConfig, rng: np.random.Generator, batch_size: int) -> dict:
  lo, hi = cfg.train_lengths
  return batch(cfg, rng, batch_size, hi, lo)


def eval_splits(cfg: StateConfig) -> list:
  return [Split(f"T{T}", cfg.eval_examples, lambda rng, start, n, T=T: batch(cfg, rng, n, T))
          for T in cfg.eval_lengths]
