"""Timing, memory and operation counts of compiled JAX programs, as every benchmark reports them."""

from __future__ import annotations

import re
import statistics
import time

import jax


def timed(fn, args, reps: int, sync=jax.block_until_ready) -> float:
  """Median milliseconds of `fn(*args)` over `reps` calls, each followed by `sync(result)` (default: blocked until
  JAX's arrays are ready; for PyTorch, `lambda _: torch.cuda.synchronize()`), after one untimed call."""
  sync(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(fn(*args))
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


# Instructions of a compiled program that launch no work of their own: plumbing, and control flow (whose bodies
# are counted instead).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
         "add-dependency", "while", "conditional", "call"}


def _computations(text: str) -> tuple:
  """({computation name: [instruction lines]}, entry name) of compiled HLO text."""
  comps, name, entry = {}, None, None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = re.match(r"(?:ENTRY\s+)?%?([^\s(]+)", line).group(1)
      comps[name] = []
      entry = name if line.startswith("ENTRY") else entry
    elif line.strip() == "}":
      name = None
    elif name is not None and " = " in line:
      comps[name].append(line)
  return comps, entry


def _op(line: str) -> str:
  m = re.search(r" = .*?\s([a-z][\w-]*)\(", line)
  return m.group(1) if m else ""


def _count(comps: dict, name: str) -> int:
  """Operations one run of computation `name` executes: every instruction that is not free, a fusion counting
  once; a while loop its body and condition times the known trip count (once if unknown), a conditional its
  largest branch, a call its callee."""
  total = 0
  for line in comps.get(name, ()):
    op = _op(line)
    if op == "while":
      trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
      body, cond = (re.search(rf"{k}=%?([^\s,]+)", line).group(1) for k in ("body", "condition"))
      total += (int(trip.group(1)) if trip else 1) * (_count(comps, body) + _count(comps, cond))
    elif op == "conditional":
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
      names += [m.group(1) for m in re.finditer(r"(?:true|false)_computation=%?([^\s,]+)", line)]
      total += max((_count(comps, b) for b in names), default=0)
    elif op == "call":
      total += _count(comps, re.search(r"to_apply=%?([^\s,]+)", line).group(1))
    elif op and op not in _FREE:
      total += 1
  return total


def ops_per_iteration(compiled) -> int:
  """The operations (fusions, library calls such as cuBLAS matmuls, copies, ...) that one iteration of the
  program's largest top-level loop executes, nested loops counted times their trip counts: for a decode loop,
  about the kernels that one step launches. A count of the compiled HLO, not a trace: a library call may launch
  more than one kernel."""
  comps, entry = _computations(compiled.as_text())
  best = 0
  for line in comps[entry]:
    if _op(line) == "while":
      body, cond = (re.search(rf"{k}=%?([^\s,]+)", line).group(1) for k in ("body", "condition"))
      best = max(best, _count(comps, body) + _count(comps, cond))
  return best
