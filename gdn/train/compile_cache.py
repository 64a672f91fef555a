"""XLA's persistent compilation cache for runs and sweeps (`config.compilation_cache`).

A sweep's cells share their compiled programs through it: cells that differ only in the seed or in AdamW's
numbers (the learning rate among them: they live in the optimizer state, gdn/train/optimizer.py) compile
nothing again, and neither does a resumed run.
"""

from __future__ import annotations

import os
from typing import Optional

import jax


def cache_dir(compilation_cache: str, run_dir: str) -> Optional[str]:
  """The directory `compilation_cache` names: "auto" = `.jax_cache` beside the run's work directory (so that
  a sweep's runs, which sit side by side, share it), "" = none, anything else = that directory."""
  if compilation_cache == "auto":
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), ".jax_cache")
  return compilation_cache or None


def enable(compilation_cache: str, run_dir: str) -> Optional[str]:
  """Points jax's persistent cache at `cache_dir(...)` unless a directory is set already (by the
  JAX_COMPILATION_CACHE_DIR environment variable or earlier in the process): the cache is set up once per
  process, so the first directory stays. Returns the directory in use, or None."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = cache_dir(compilation_cache, run_dir)
  if path is not None:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
  return path
