"""The op as the function a benchmark times: a gdn method (or a chunk variant, or the plain XLA port) as a
function of (q, k, v, g, beta), and a function's forward+backward with its cotangents as an argument."""

from __future__ import annotations

import jax
import numpy as np

from gdn.bench.plain_port import plain_port
from gdn.ops import gated_delta_rule
from gdn.ops.chunk import chunk


def make_fn(method, dims, g_lower_bound=None):
  """`method` is a gdn method name, "plain_port", or a chunk variant: "chunk_remat", "chunk_triangular",
  "chunk_blocked" (the triangular solver forced). g_lower_bound: the op's (gdn methods only)."""
  if method == "plain_port":
    return lambda q, k, v, g, b: plain_port(q, k, v, g, b)[0].astype(v.dtype)
  if not method.startswith("chunk_"):
    return lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, method=method, chunk_size=64,
                                                  g_lower_bound=g_lower_bound)[0]
  if g_lower_bound is not None:
    raise ValueError(f"g_lower_bound is for gdn's methods, not {method!r}")
  variant = method[len("chunk_"):]
  kw = dict(remat=True) if variant == "remat" else dict(solver=variant)

  def f(q, k, v, g, b):
    return chunk(q, k, v, g, b, scale=dims.K**-0.5, initial_state=None, segment_ids=None, dims=dims,
                 chunk_size=64, **kw)[0].astype(v.dtype)

  return f


def vjp_of(f):
  """f's forward+backward as a function of (cotangents, *args): the VJP at args applied to the cotangents, which
  are an argument (closed over, they would be compiled in as constants)."""

  def fwd_bwd(cts, *a):
    _, vjp = jax.vjp(f, *a)
    return vjp(cts)

  return fwd_bwd


def rel_err(a, b) -> float:
  """max |a - b| / max |b|, in float64: how the benchmarks report a result's error against a reference."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
