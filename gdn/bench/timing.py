"""Timing and memory of compiled JAX programs, as every benchmark reports them."""

from __future__ import annotations

import statistics
import time

import jax


def timed(fn, args, reps: int) -> float:
  """Median milliseconds of `fn(*args)` over `reps` calls, each blocked until ready, after one untimed call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def compiled_bytes(compiled):
  """XLA's buffer assignment of a compiled program: arguments + outputs + temporaries, less what is aliased
  (donated); None on backends that give no estimate."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def peak_bytes(jitted, args) -> float:
  """`compiled_bytes` of `jitted` lowered for `args`; NaN where the backend gives no estimate."""
  b = compiled_bytes(jitted.lower(*args).compile())
  return float("nan") if b is None else b


def device_memory_stats(device=None) -> dict:
  """The allocator's statistics (bytes_in_use, peak_bytes_in_use, bytes_limit, ...) of `device` (default: the
  first), or {} on backends that keep none (the CPU)."""
  try:
    return (device or jax.devices()[0]).memory_stats() or {}
  except Exception:  # backends without allocator statistics raise rather than return None
    return {}


def time_steps(step, sync, *, warmup: int, steps: int) -> dict:
  """Runs `step()` warmup times untimed (the first may compile), then `steps` times, each followed by `sync()`
  (waiting until its results are ready). Returns first_s (the first call, compile included) and the median and
  all step times in ms."""
  if warmup < 1 or steps < 1:
    raise ValueError(f"warmup and steps must be >= 1, got warmup={warmup}, steps={steps}")
  t0 = time.perf_counter()
  step()
  sync()
  first_s = time.perf_counter() - t0
  for _ in range(warmup - 1):
    step()
  sync()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    step()
    sync()
    times.append(1e3 * (time.perf_counter() - t0))
  return dict(first_s=first_s, step_ms=statistics.median(times), times_ms=times)
