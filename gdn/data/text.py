"""Language modelling on local text: raw bytes of a corpus directory, or pre-tokenised .bin token files.

The default corpus is the running interpreter's standard library source (`sysconfig` "stdlib", every
`*.py` outside site-packages / dist-packages): about 1,800 files and 30 MB on CPython 3.11, present on every
machine with Python. Files go to validation by a hash of their relative path, so the split is the same on
every machine with the same Python version. Token files are flat arrays of `token_dtype` (the nanoGPT .bin
layout), memory-mapped, never loaded whole.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sysconfig
import zlib
from typing import Optional

import grain
import numpy as np

from gdn.data.pipeline import Split

_SEPARATOR = 0  # joins files; NUL never occurs in source text


@dataclasses.dataclass(frozen=True)
class TextConfig:
  seq_len: int = 512
  eval_examples: int = 256  # validation windows, spread evenly over the validation stream
  corpus_dir: str = ""  # bytes: "" = the Python standard library's source
  glob: str = "**/*.py"
  val_fraction: float = 0.05
  train_file: str = ""  # tokens: .bin files of `token_dtype`
  val_file: str = ""
  token_dtype: str = "uint16"
  vocab_size: int = 50304  # tokens only; bytes always have 256
  # Refuse a run that would see a training window twice: steps x batch_size windows must fit in the train split.
  single_pass: bool = False

  def __post_init__(self):
    if self.eval_examples < 1:
      raise ValueError(f"eval_examples must be >= 1, got {self.eval_examples}")
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
    if self.token_dtype not in ("uint8", "uint16", "uint32", "int32"):
      raise ValueError(f"token_dtype must be uint8, uint16, uint32 or int32, got {self.token_dtype!r}")


def default_corpus_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def corpus_files(corpus_dir: str, glob: str) -> list:
  root = pathlib.Path(corpus_dir or default_corpus_dir())
  if not root.is_dir():
    raise FileNotFoundError(f"config.data.text.corpus_dir {str(root)!r} is not a directory")
  skip = {"site-packages", "dist-packages", "__pycache__"}
  files = sorted(p for p in root.glob(glob) if p.is_file() and not skip & set(p.relative_to(root).parts))
  if not files:
    raise FileNotFoundError(f"no files match config.data.text.glob {glob!r} under config.data.text.corpus_dir "
                            f"{str(root)!r}")
  return [(str(p.relative_to(root)), p) for p in files]


@functools.lru_cache(maxsize=4)
def byte_streams(corpus_dir: str, glob: str, val_fraction: float) -> tuple:
  """(train bytes, validation bytes) as uint8 arrays, split by file."""
  parts = {False: [], True: []}
  for rel, path in corpus_files(corpus_dir, glob):
    is_val = zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000
    parts[is_val].append(path.read_bytes())
  if not parts[True] or not parts[False]:
    raise ValueError(f"val_fraction {val_fraction} leaves an empty train or validation split")
  sep = bytes([_SEPARATOR])
  return tuple(np.frombuffer(sep.join(parts[v]), np.uint8) for v in (False, True))


def token_stream(path: str, dtype: str, key: str = "train_file", vocab_size: Optional[int] = None) -> np.ndarray:
  """The tokens of `path` (config.data.text.<key>), memory-mapped. With `vocab_size`, every token is checked to
  be below it, once per process and file (one pass over the file), so that a wrong
  token_dtype or vocabulary fails here and not as a silent out-of-range embedding lookup later."""
  name = f"config.data.text.{key}"
  if not path:
    raise FileNotFoundError(f"{name} is empty: data.task='tokens' reads a flat file of {dtype} tokens")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{name} {path!r} does not exist")
  size, width = os.path.getsize(path), np.dtype(dtype).itemsize
  if size == 0 or size % width:
    raise ValueError(f"{name} {path!r} has {size} bytes, not a non-zero multiple of {width} "
                     f"(config.data.text.token_dtype={dtype!r})")
  tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
  if vocab_size is not None:
    _check_tokens(path, dtype, os.path.getmtime(path), vocab_size, name)
  return tokens


@functools.lru_cache(maxsize=8)
def _check_tokens(path: str, dtype: str, mtime: float, vocab_size: int, name: str) -> None:
  tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
  step = 1 << 26
  for start in range(0, len(tokens), step):
    part = tokens[start:start + step]
    lo, hi = int(part.min()), int(part.max())
    if lo < 0 or hi >= vocab_size:
      at = start + int(np.argmax((part < 0) | (part >= vocab_size)))
      raise ValueError(f"{name} {path!r} holds token {int(tokens[at])} at position {at}, outside "
                       f"[0, config.data.text.vocab_size={vocab_size}) (config.data.text.token_dtype={dtype!r})")


class Windows:
  """Non-overlapping windows of seq_len + 1 tokens of a stream, as a grain random-access source."""

  def __init__(self, stream: np.ndarray, seq_len: int, what: str = "a stream"):
    self.stream, self.seq_len = stream, seq_len
    self.n = (len(stream) - 1) // seq_len
    if self.n < 1:
      raise ValueError(f"{what} of {len(stream)} tokens is shorter than one window of "
                       f"config.data.text.seq_len + 1 = {seq_len + 1}")

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    s = self.seq_len * i
    return np.asarray(self.stream[s:s + self.seq_len + 1], np.int32)


def _example(window):
  return dict(inputs=window[..., :-1], targets=window[..., 1:], weights=np.ones(window[..., 1:].shape, np.float32))


def streams(cfg: TextConfig, kind: str) -> tuple:
  if kind == "bytes":
    return byte_streams(cfg.corpus_dir, cfg.glob, cfg.val_fraction)
  return tuple(token_stream(getattr(cfg, key), cfg.token_dtype, key, cfg.vocab_size)
               for key in ("train_file", "val_file"))


def split_name(cfg: TextConfig, kind: str, split: str) -> str:
  """What a split's stream comes from, for errors: its token file's config key, or the byte corpus' split."""
  if kind == "bytes":
    return f"the {split} split of config.data.text.corpus_dir {cfg.corpus_dir!r}"
  return f"config.data.text.{split}_file {getattr(cfg, split + '_file')!r}"


def train_dataset(cfg: TextConfig, kind: str, batch_size: int, seed: int, num_batches: int,
                  rows: Optional[slice] = None) -> grain.MapDataset:
  """Shuffled windows, reshuffled every epoch, batched; element i is batch i, or its `rows` only."""
  train, _ = streams(cfg, kind)
  windows = Windows(train, cfg.seq_len, split_name(cfg, kind, "train"))
  if cfg.single_pass:
    check_single_pass(len(windows), num_batches, batch_size, cfg.seq_len)
  ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat(None)
  if rows is None:
    return ds.batch(batch_size, drop_remainder=True).map(_example)[:num_batches]
  # Row r of batch i is window i * batch_size + r of the shuffled stream (what `batch` stacks), and windows are
  # read one by one, so a process reads only its own rows' windows.
  picks = np.arange(batch_size)[rows]
  return grain.MapDataset.range(num_batches).map(
      lambda i: _example(np.stack([ds[i * batch_size + r] for r in picks])))


def check_single_pass(num_windows: int, num_batches: int, batch_size: int, seq_len: int) -> None:
  """The shuffled windows repeat only after all `num_windows` have been drawn, so a run of `num_batches`
  batches sees no training token twice exactly when num_batches * batch_size <= num_windows."""
  need = num_batches * batch_size
  if need > num_windows:
    raise ValueError(
        f"config.data.text.single_pass: config.train.steps (or stop_step) {num_batches} x config.data.batch_size "
        f"{batch_size} = {need:,} windows of config.data.text.seq_len + 1 = {seq_len + 1} tokens, but the train "
        f"split has {num_windows:,} ({num_windows * seq_len:,} tokens): the run would see tokens twice. Lower "
        f"steps or batch_size, or build a larger corpus (config.data.text.train_file)")


def eval_splits(cfg: TextConfig, kind: str) -> list:
  _, val = streams(cfg, kind)
  windows = Windows(val, cfg.seq_len, split_name(cfg, kind, "val"))
  n = min(cfg.eval_examples, len(windows))
  picks = np.linspace(0, len(windows) - 1, n).astype(int)

  def make(rng, start, count):
    del rng  # the validation windows are fixed
    return _example(np.stack([windows[i] for i in picks[start:start + count]]))

  return [Split("val", n, make)]
