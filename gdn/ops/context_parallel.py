"""Context parallelism: the gated delta rule with the time axis sharded over one axis of a device mesh.

Shapes: B batch, T time, L = T / D time steps per device, D devices on the axis, H q/k heads, HV value heads,
K key dim, V value dim, N chunks per device, C chunk size.

The recurrence over a device's slice is one affine map of the entering state, S -> M S + B (M [K, K],
B [K, V] per head; M the product of the slice's chunk maps, B the accumulated offset). Each device

  1. runs the chunk-local work of its slice (`chunk.prepare`) and composes its slice map (M, B), either by a
     sequential scan over its chunks (method="chunk") or by an associative scan (method="associative");
  2. all-gathers the D maps and folds them from `initial_state` up to its own index: its entering state;
  3. computes its chunks' entering states and its outputs from that state.

`local_gated_delta_rule` is one device's part, for callers already inside a `shard_map` over the axis (the
models under `gdn.parallel.context_parallel_apply`, which run all their layers in one); the public
`context_parallel_gated_delta_rule` pads the sequence and wraps that part in its own `shard_map`.

Communication per layer and per batch row, for one mesh axis of D devices (float32, HV heads):
  forward  one all-gather of HV (K^2 + K V) floats from each device (HV (K + K V) without the delta rule,
           where M is diagonal), so each device receives (D - 1) HV (K^2 + K V) floats; one all-reduce of the
           final state (HV K V) so that every device holds it; with segment_ids one point-to-point shift of
           one integer (the previous slice's last id).
  backward the transposes: a reduce-scatter of the same size as the all-gather and a broadcast of the final
           state's cotangent.
The gathered maps are kept for the backward pass (also under `remat=True`), so it repeats no all-gather.
With K = V = 128, HV = 16, D = 8 this is 2 MiB sent and 14 MiB received per device and per batch row in the
forward, against 768 MiB of q, k, v for a 32K-token slice in float32: the map exchange is cheap beside the
per-device work.
Passing states along a ring instead (device d waits for device d - 1's end state, applies its map and sends
on) moves only HV K V floats per hop, but runs D - 1 dependent point-to-point steps one after the other, each
paying a collective's latency; one all-gather has log or single-step depth, and the fold over D maps that
every device then repeats costs D HV K^2 V flops, nothing beside its slice's chunk work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from gdn.ops import associative, checks, chunk, intra_chunk

try:  # jax >= 0.7 exposes shard_map at the top level; older releases only in jax.experimental
  from jax import shard_map as _shard_map
except ImportError:  # pragma: no cover
  from jax.experimental.shard_map import shard_map as _shard_map

METHODS = ("auto", "chunk", "associative")
MAPS = "gdn_cp_maps"  # checkpoint name of the all-gathered slice maps: with remat the backward gathers nothing


def context_parallel_gated_delta_rule(q, k, v, g=None, beta=None, *, mesh, axis_name, scale=None,
                                      initial_state=None, segment_ids=None, method="auto", chunk_size=64,
                                      batch_axis_name=None, remat=False, g_lower_bound=None):
  """`gdn.ops.gated_delta_rule` with the time axis of q, k, v, g, beta and segment_ids split over the mesh
  axis `axis_name` (device d holds time steps [d L, (d + 1) L)). Same recurrence, per value head and step:

    S   <- Diag(exp(g_t)) S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T  (S + k_t v_t^T if beta is None)
    o_t  = S^T (scale * q_t)

  Args:
    q, k: [B, T, H, K]. v: [B, T, HV, V]. g: None, [B, T, HV] or [B, T, HV, K]. beta: None or [B, T, HV]
      (per-value-channel beta is declined: its slice map is one [K, K] matrix per value channel).
    mesh: a `jax.sharding.Mesh` with the axis `axis_name`; batch_axis_name: None, another of its axes or a
      tuple of them, over which the batch is split as well (data parallelism beside context parallelism).
    initial_state: None or [B, HV, K, V]. segment_ids: None or [B, T] integers; a segment may start anywhere,
      on a slice boundary or inside a slice, and may span several slices.
    method: "auto" (= "chunk"), "chunk" or "associative": how a device scans its own chunks.
    T need not be a multiple of D or of chunk_size: the sequence is padded at its end with steps that leave
      the state unchanged, and the padding is cut from the output.
    remat: keep for the backward only the chunk-entering states and the gathered maps and recompute the
      chunk-local work (off by default, as in the single-device ops).
    g_lower_bound: as `gdn.ops.gated_delta_rule`'s (the rule on max(g, bound); KDA's bounded chunk-local form).
  Returns:
    o [B, T, HV, V] in v's dtype (split over `axis_name` like v where D divides T), and the final state
    [B, HV, K, V] (float32): the last device's end state, replicated over `axis_name`.
  """
  dims = checks.check_sequence(q, k, v, g, beta, initial_state, segment_ids, scale, "chunk", chunk_size)
  _check_supported(dims, method)
  D = check_mesh_axes(mesh, axis_name, batch_axis_name, dims.B)

  # Padding steps (k = v = g = beta = 0, the last segment continued) leave the state unchanged.
  L = -(-dims.T // D)
  pad = L * D - dims.T
  pad_t = lambda x: x if x is None or not pad else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  if pad and segment_ids is not None:
    segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
  seq = PartitionSpec(batch_axis_name, axis_name)
  rows = PartitionSpec(batch_axis_name)
  args = (pad_t(q), pad_t(k), pad_t(v), pad_t(g), pad_t(beta), initial_state, segment_ids)
  specs = (seq, seq, seq, seq, seq, rows, seq)
  args = tuple(place(x, mesh, s) for x, s in zip(args, specs))

  def body(q, k, v, g, beta, initial_state, segment_ids):
    return local_gated_delta_rule(q, k, v, g, beta, axis_name=axis_name, scale=scale, initial_state=initial_state,
                                  segment_ids=segment_ids, method=method, chunk_size=chunk_size, remat=remat,
                                  g_lower_bound=g_lower_bound)

  o, S_T = _shard_map(body, mesh=mesh, in_specs=specs, out_specs=(seq, rows))(*args)
  if pad:
    # An Explicit axis cannot split the unpadded length evenly: the cut output is not split over time.
    o = place(o, mesh, rows)
  return o[:, :dims.T], S_T


def local_gated_delta_rule(q, k, v, g=None, beta=None, *, axis_name, scale=None, initial_state=None,
                           segment_ids=None, method="auto", chunk_size=64, remat=False, g_lower_bound=None):
  """One device's part of `context_parallel_gated_delta_rule`, to be called where the mesh axis `axis_name`
  is bound (inside a `shard_map`): the arguments are this device's slice, device d of the axis holding time
  steps [d L, (d + 1) L) of the sequence. Every device's slice has the same length L, which need not be a
  multiple of chunk_size.

  Args:
    q, k: [B, L, H, K]. v: [B, L, HV, V]. g: None, [B, L, HV] or [B, L, HV, K]. beta: None or [B, L, HV].
    initial_state: None or [B, HV, K, V], the state entering the whole sequence (the same on every device).
    segment_ids: None or [B, L], this slice of the sequence's ids. Others (g_lower_bound included) as
      `context_parallel_gated_delta_rule`.
  Returns:
    o [B, L, HV, V] in v's dtype (this slice's outputs) and the final state [B, HV, K, V] (float32) of the
    whole sequence, the same on every device.
  """
  dims = checks.check_sequence(q, k, v, g, beta, initial_state, segment_ids, scale, "chunk", chunk_size)
  _check_supported(dims, method)
  g, bound = intra_chunk.clamp_to_bound(g, g_lower_bound)
  body = functools.partial(_slice, dims=dims, axis_name=axis_name, scale=checks.default_scale(scale, dims.K),
                           method="chunk" if method == "auto" else method, chunk_size=chunk_size,
                           g_lower_bound=bound)
  if remat:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names(chunk.STATES, MAPS))
  return body(q, k, v, g, beta, initial_state, segment_ids)


def _check_supported(dims, method):
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS} for context parallelism, got {method!r} (the token "
                     "scan 'recurrent' has no slice map; use gdn.ops.gated_delta_rule on one device)")
  if dims.beta_kind == "channel":
    raise ValueError("context_parallel_gated_delta_rule does not support per-value-channel beta "
                     "([B, T, HV, V]): each value channel would need its own [K, K] slice map; use a per-head "
                     "beta [B, T, HV] or gdn.ops.gated_delta_rule on one device")


# jax 0.11.2's Shardy partitioner crashes (segfault while compiling) on the gradient through a shard_map of an
# associative scan that keeps its intermediates for the backward; the smallest case is
# jax.grad(lambda x: shard_map(lambda x: lax.associative_scan(jnp.multiply, x, axis=1), ...)(x).sum()). Under
# jax.checkpoint the scan's intermediates are recomputed in the backward instead of crossing the shard_map's
# boundary, and it compiles. jax 0.10 compiles either way, so it keeps the intermediates.
_REMAT_ASSOCIATIVE_SCAN = jax.__version_info__ >= (0, 11)


def _slice(q, k, v, g, beta, initial_state, segment_ids, *, dims, axis_name, scale, method, chunk_size,
           g_lower_bound=None):
  """One device's part: its slice [B, L, ...] in, its outputs [B, L, HV, V] and the replicated final state out."""
  d, D = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
  loc, vc, bc, N, cdt, prec = chunk.prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, dims=dims,
                                            chunk_size=chunk_size, g_lower_bound=g_lower_bound)
  if method == "associative":
    Mc, Bc = associative.cumulative_maps(loc, prec, remat_scan=_REMAT_ASSOCIATIVE_SCAN)
    M, B = Mc[:, :, -1], Bc[:, :, -1]
  else:
    M, B = _slice_map_sequential(loc, bc, prec)

  # A segment that starts exactly at this slice's first step cuts the entering state, which the slice's
  # own masks cannot see: they start at its first step.
  fresh = None
  if segment_ids is not None:
    prev_last = jax.lax.ppermute(segment_ids[:, -1], axis_name, [(i, i + 1) for i in range(D - 1)])
    fresh = (d > 0) & (segment_ids[:, 0] != prev_last)
    M = _where_rows(fresh, 0.0, M)

  Ms, Bs = checkpoint_name(jax.lax.all_gather((M, B), axis_name), MAPS)  # [D, B, HV, ...]
  S0 = _vary_like(chunk.initial(initial_state, dims, cdt), Bs)

  def fold(S, map_d):
    M_d, B_d = map_d
    return associative.apply(M_d, S, prec) + B_d, S

  _, S_enter = jax.lax.scan(fold, S0, (Ms, Bs))
  S_d = S_enter[d]
  if fresh is not None:
    S_d = _where_rows(fresh, 0.0, S_d)

  if method == "associative":
    S_in, S_end = associative.states_from_maps(Mc, Bc, S_d, prec)
    U = chunk.write_vectors(loc, S_in, bc, prec)
  else:
    S_end, S_in, U = chunk.scan_chunks(loc, bc, S_d, prec)
  S_in = checkpoint_name(S_in, chunk.STATES)
  o = chunk.finish(loc, S_in, U, prec, dims, chunk_size)
  # Only the last device's end state is the sequence's; the sum over devices replicates it.
  S_T = jax.lax.psum(jnp.where(d == D - 1, S_end, 0.0), axis_name)
  return o.astype(v.dtype), S_T


def _slice_map_sequential(loc, bc, prec):
  """The slice map (M, B) by a sequential scan over its chunks, of the stacked state [M | B] [.., K, K + V]
  from [I | 0], whose first K columns see no write: the memory of `method="chunk"` (no per-chunk maps)."""
  Bsz, HV, N, C, K = loc.k_end.shape
  dtype = chunk.compute_dtype(loc.U.dtype)  # the state's (float32), not the chunk-local operands' (16-bit)
  if loc.W is None:
    # Without the delta rule M is the product of the chunk decays (diagonal); only B needs the scan.
    B0 = _vary_like(jnp.zeros((Bsz, HV, K, loc.U.shape[-1]), dtype), loc.U)
    return jnp.prod(loc.decay, axis=2), chunk.scan_chunks(loc, bc, B0, prec, collect=False)[0]
  stacked = dataclasses.replace(loc, U=jnp.concatenate([jnp.zeros_like(loc.W), loc.U], axis=-1))
  X0 = jnp.concatenate([jnp.broadcast_to(jnp.eye(K, dtype=dtype), (Bsz, HV, K, K)),
                        jnp.zeros((Bsz, HV, K, loc.U.shape[-1]), dtype)], axis=-1)
  X = chunk.scan_chunks(stacked, bc, _vary_like(X0, loc.U), prec, collect=False)[0]
  return X[..., :K], X[..., K:]


def _where_rows(rows, value, x):
  """x with the batch rows where `rows` [B] is set replaced by `value`."""
  return jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), value, x)


def _vary_like(x, like):
  """x marked as varying over the manual mesh axes that `like` varies over, which shard_map's type check
  asks of a scan carry that starts from a replicated value and picks up per-device data."""
  missing = tuple(sorted(_varying_axes(like) - _varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def _varying_axes(x) -> frozenset:
  """The manual mesh axes x varies over (`manual_axis_type.varying` in jax 0.10, `vma` before)."""
  aval = jax.typeof(x)
  kind = getattr(aval, "manual_axis_type", None)
  return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def check_mesh_axes(mesh, axis_name, batch_axis_name, B: int) -> int:
  """The size D of the sequence axis `axis_name`, after checking that it and `batch_axis_name` (None, a second
  axis or a tuple of axes, over which the batch B is split) are axes of the mesh, that they differ and that B
  splits."""
  batch_axes = batch_axis_name if isinstance(batch_axis_name, tuple) else (batch_axis_name,)
  batch_axes = tuple(a for a in batch_axes if a is not None)
  for arg, name in [("axis_name", axis_name)] + [("batch_axis_name", a) for a in batch_axes]:
    if name not in mesh.axis_names:
      raise ValueError(f"{arg}={name!r} is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}")
  if axis_name in batch_axes:
    raise ValueError(f"batch_axis_name must differ from axis_name, both are {axis_name!r}")
  if len(set(batch_axes)) != len(batch_axes):
    raise ValueError(f"batch_axis_name names an axis twice: {batch_axis_name!r}")
  Db = 1
  for a in batch_axes:
    Db *= mesh.shape[a]
  if B % Db:
    raise ValueError(f"the batch B={B} must be a multiple of the mesh axis {batch_axis_name!r} of size {Db}")
  return mesh.shape[axis_name]


def place(x, mesh, spec):
  """x resharded to `spec` where the mesh's axes are Explicit (shard_map then asks for matching input types);
  on Auto axes shard_map moves the data itself."""
  if x is None:
    return None
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ())):
    return jax.reshard(x, NamedSharding(mesh, spec))
  return x
