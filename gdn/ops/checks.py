"""Argument checking for the gated delta rule ops: clear errors before any tracing.

Shape legend: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("auto", "recurrent", "chunk", "associative", "pallas")


def scoped(name: str):
  """Decorator: run the function under `jax.named_scope(name)`, so that its operations carry the stage's name in
  XLA's metadata (profiles, `gdn.bench.peak`'s table of what is live at the memory peak). No effect on results."""
  def wrap(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
      with jax.named_scope(name):
        return fn(*args, **kwargs)
    return run
  return wrap


@dataclasses.dataclass(frozen=True)
class Dims:
  B: int
  T: int
  H: int
  HV: int
  K: int
  V: int
  g_kind: str  # "none" | "head" | "channel"
  beta_kind: str  # "none" | "head" | "channel"


def _shape(x) -> tuple:
  return tuple(np.shape(x))


def _require_float(name: str, x) -> None:
  try:
    dtype = jnp.result_type(x)
  except TypeError:  # a nested Python list, say: jax's own message would not name the argument
    raise TypeError(f"{name} must be a floating-point array, got {type(x).__name__}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def _gate_kind(name: str, x, lead: tuple, last: int, last_name: str, axes: str = "B, T, HV") -> str:
  """Classify g or beta as absent, one value per head, or one per channel; `axes` names `lead`'s axes."""
  if x is None:
    return "none"
  _require_float(name, x)
  s = _shape(x)
  if s == lead:
    return "head"
  if s == lead + (last,):
    return "channel"
  want = ", ".join(map(str, lead))
  raise ValueError(
      f"{name} must be None, of shape [{axes}] = ({want}) or [{axes}, {last_name}] = "
      f"({want}, {last}); got {s}")


def check_sequence(q, k, v, g, beta, initial_state, segment_ids, scale, method, chunk_size) -> Dims:
  """Validate the arguments of `gated_delta_rule`; returns the problem dimensions."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      want = "[B, T, HV, V]" if name == "v" else "[B, T, H, K]"
      raise ValueError(f"{name} must have rank 4 {want}, got shape {_shape(x)}")
    _require_float(name, x)
  B, T, H, K = _shape(q)
  if _shape(k) != (B, T, H, K):
    raise ValueError(f"k must have the shape of q [B, T, H, K] = {(B, T, H, K)}, got {_shape(k)}")
  Bv, Tv, HV, V = _shape(v)
  if (Bv, Tv) != (B, T):
    raise ValueError(f"v must be [B, T, HV, V] with B, T = {(B, T)} as in q, got {_shape(v)}")
  if HV % H:
    raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H} (v shape {_shape(v)})")
  if T == 0:
    raise ValueError("q, k, v must have at least one time step (T >= 1), got T=0")
  lead = (B, T, HV)
  g_kind = _gate_kind("g", g, lead, K, "K")
  beta_kind = _gate_kind("beta", beta, lead, V, "V")
  check_state("initial_state", initial_state, B, HV, K, V)
  if segment_ids is not None:
    if _shape(segment_ids) != (B, T):
      raise ValueError(f"segment_ids must be None or of shape [B, T] = {(B, T)}, got {_shape(segment_ids)}")
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
      raise TypeError(f"segment_ids must be an integer array [B, T], got dtype {jnp.result_type(segment_ids)}")
  check_scale(scale)
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
  return Dims(B, T, H, HV, K, V, g_kind, beta_kind)


def check_step(q_t, k_t, v_t, g_t, beta_t, state, scale) -> Dims:
  """Validate the arguments of `gated_delta_rule_step` (no time axis)."""
  for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
    if np.ndim(x) != 3:
      want = "[B, HV, V]" if name == "v_t" else "[B, H, K]"
      raise ValueError(f"{name} must have rank 3 {want}, got shape {_shape(x)}")
    _require_float(name, x)
  B, H, K = _shape(q_t)
  if _shape(k_t) != (B, H, K):
    raise ValueError(f"k_t must have the shape of q_t [B, H, K] = {(B, H, K)}, got {_shape(k_t)}")
  Bv, HV, V = _shape(v_t)
  if Bv != B:
    raise ValueError(f"v_t must be [B, HV, V] with B={B} as in q_t, got {_shape(v_t)}")
  if HV % H:
    raise ValueError(f"v_t's head count HV={HV} must be a multiple of q_t/k_t's H={H}")
  g_kind = _gate_kind("g_t", g_t, (B, HV), K, "K", axes="B, HV")
  beta_kind = _gate_kind("beta_t", beta_t, (B, HV), V, "V", axes="B, HV")
  if state is None:
    raise ValueError(f"state is required: an array [B, HV, K, V] = {(B, HV, K, V)}")
  check_state("state", state, B, HV, K, V)
  check_scale(scale)
  return Dims(B, 1, H, HV, K, V, g_kind, beta_kind)


def check_state(name: str, s, B: int, HV: int, K: int, V: int) -> None:
  if s is None:
    return
  if _shape(s) != (B, HV, K, V):
    raise ValueError(f"{name} must be of shape [B, HV, K, V] = {(B, HV, K, V)}, got {_shape(s)}")
  _require_float(name, s)


def check_scale(scale) -> None:
  if isinstance(scale, (jax.Array, np.ndarray)) and np.ndim(scale) != 0:
    raise ValueError(f"scale must be None or a scalar, got an array of shape {_shape(scale)}")
  if scale is None or isinstance(scale, (jax.Array, np.ndarray)):
    return
  if not isinstance(scale, (int, float, np.number)) or isinstance(scale, bool):
    raise TypeError(f"scale must be None or a number, got {type(scale).__name__}")


def default_scale(scale: Optional[float], K: int) -> float:
  return K**-0.5 if scale is None else scale


def check_g_lower_bound(bound, g, lowest: float, name: str = "g_lower_bound") -> Optional[float]:
  """`g_lower_bound` (or the argument `name`) validated: None, or a Python or NumPy real in [lowest, 0) (a static
  value: it picks the program), given with a g (anything but None); returned as a float."""
  if bound is None:
    return None
  if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be None or a float in [{lowest:g}, 0) (a static value, not an array), "
                    f"got {type(bound).__name__}")
  if not lowest <= float(bound) < 0:
    raise ValueError(f"{name} must be in [{lowest:g}, 0) (16 steps of a sub-chunk times it must stay "
                     f"within float32's exp range), got {bound!r}")
  if g is None:
    raise ValueError(f"{name} bounds the log-decay g, but g is None (no decay)")
  return float(bound)
