"""What a function's backward keeps: the residuals of `jax.vjp`, read from its jaxpr, with their bytes.

The residuals are the leaves of the vjp function that `jax.vjp(fn, *args)` returns (what the forward leaves for
the backward). Traced abstractly (`jax.make_jaxpr`), so nothing runs; residuals that are `fn`'s own arguments
are reported apart (they are live whether or not the backward keeps them).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple
  dtype: str
  what: str  # "argument", or the primitive that made it and where (the name stack of its equation)

  @property
  def bytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def saved_residuals(fn, *args) -> list:
  """The residuals `jax.vjp(fn, *args)` keeps for the backward, as `Residual`s (one per kept array)."""
  closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
  jaxpr = closed.jaxpr
  made_by = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  invars = {id(v) for v in jaxpr.invars}
  out, seen = [], set()
  for v in jaxpr.outvars:  # Vars, or Literals (constants folded into the jaxpr); compared by identity
    aval = v.aval
    if not hasattr(aval, "shape") or id(v) in seen:  # an array kept twice is held once
      continue
    seen.add(id(v))
    if id(v) in invars:
      what = "argument"
    elif id(v) in made_by:
      eqn = made_by[id(v)]
      stack = str(getattr(eqn.source_info, "name_stack", "")) or "-"
      what = f"{eqn.primitive.name} {stack}"
    else:
      what = "constant"
    out.append(Residual(tuple(aval.shape), str(aval.dtype), what))
  return out


def residual_bytes(residuals, *, arguments: bool = False) -> int:
  """Total bytes of `residuals`, without those that are the function's arguments unless `arguments`."""
  return sum(r.bytes for r in residuals if arguments or r.what != "argument")


def summarize(residuals, top: int = 12) -> list:
  """[(bytes, count, shape, dtype, what)] of the non-argument residuals grouped by shape, dtype and origin,
  largest first, at most `top` rows."""
  groups = collections.defaultdict(lambda: [0, 0])
  for r in residuals:
    if r.what == "argument":
      continue
    g = groups[(r.shape, r.dtype, r.what)]
    g[0] += r.bytes
    g[1] += 1
  rows = sorted(((b, n) + key for key, (b, n) in groups.items()), key=lambda row: -row[0])
  return rows[:top]
