"""Sharded training on a named device mesh: data parallelism and FSDP through JAX's own SPMD partitioner, and
context parallelism beside them.

The mesh has axes ("data", "fsdp"). Batches split their batch axis over both; every parameter (and its
optimizer moments) splits its largest axis that the "fsdp" size divides, the rest is replicated. XLA inserts
the all-gathers and reduce-scatters; one device is the mesh (1, 1) and runs the same code unchanged.
With context parallelism (seq > 1) the mesh is ("data", "fsdp", "seq"): batches split their time axis over
"seq" as well, parameters stay split over "fsdp" only (replicated over "seq"), and the train step runs the
model under `gdn.parallel.context_parallel_apply` (gdn/train/step.py).
Several hosts: call `jax.distributed.initialize()` first (see docs/scaling.md), then build the mesh over
`jax.devices()` as here. Each process then loads only the rows of a batch that its own devices hold
(`process_rows`) and `shard_batch` assembles the global arrays from every process's rows.

Shapes: B global batch, Bp the rows one process holds (B when there is one process), P processes.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STACKED = "scanned_blocks"  # gdn.model.LanguageModel's stacked layers under scan_layers
AXES = ("data", "fsdp")  # the axes that split the batch
SEQ = "seq"  # the axis that splits the time axis under context parallelism


def make_mesh(data: int = -1, fsdp: int = 1, devices=None, seq: int = 1) -> Mesh:
  """A ("data", "fsdp") mesh over `devices` (default all), or ("data", "fsdp", "seq") for seq > 1; data = -1
  takes what fsdp and seq leave."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if seq < 1 or n % seq:
    raise ValueError(f"seq must be a positive divisor of the device count {n}, got {seq}")
  if fsdp < 1 or n % fsdp:
    raise ValueError(f"fsdp must be a positive divisor of the device count {n}, got {fsdp}")
  if data == -1:
    data = n // (fsdp * seq)
  if seq == 1:
    if data < 1 or data * fsdp != n:
      raise ValueError(f"data * fsdp must equal the device count {n}, got data={data}, fsdp={fsdp}")
    return Mesh(np.array(devices).reshape(data, fsdp), AXES)
  if data < 1 or data * fsdp * seq != n:
    raise ValueError(f"data * fsdp * seq must equal the device count {n}, got data={data}, fsdp={fsdp}, seq={seq}")
  # seq innermost: a sequence's slices sit on neighbouring devices, which exchange halos and state maps.
  return Mesh(np.array(devices).reshape(data, fsdp, seq), AXES + (SEQ,))


def seq_size(mesh: Mesh) -> int:
  """The devices that split the time axis: 1 on a ("data", "fsdp") mesh."""
  return mesh.shape[SEQ] if SEQ in mesh.axis_names else 1


def batch_devices(mesh: Mesh) -> int:
  """The devices that split the batch axis: data * fsdp (every device without a "seq" axis)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def param_spec(shape, fsdp_size: int, *, expert: bool = False, stacked: bool = False) -> P:
  """Shard the largest axis that fsdp_size divides (ties: the first), or replicate. expert: an MoE expert stack
  [E, ...] splits its expert axis first, when fsdp_size divides E, so each device holds whole experts. stacked:
  the leading axis indexes scanned layers, which the scan slices one at a time, so it is never the one sharded."""
  if fsdp_size == 1 or not shape:
    return P()
  if expert and shape[0] % fsdp_size == 0:
    return P("fsdp", *[None] * (len(shape) - 1))
  for axis in sorted(range(int(stacked), len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % fsdp_size == 0:
      return P(*[("fsdp" if a == axis else None) for a in range(len(shape))])
  return P()


def is_stacked(path) -> bool:
  """Whether a leaf's key path runs through a scanned model's stacked layers (`LanguageModel.scanned_blocks`),
  in the parameters or in anything shaped like them (the optimizer's moments)."""
  return any(getattr(k, "key", getattr(k, "name", None)) == STACKED for k in path)


def tree_shardings(tree, mesh: Mesh):
  """NamedShardings for every array leaf of a train state (scalars and small leaves replicated)."""
  fsdp = mesh.shape["fsdp"]
  def spec(path, x):
    expert = any(getattr(k, "key", getattr(k, "name", None)) == "experts" for k in path)  # gdn.layers.moe.Experts
    return NamedSharding(mesh, param_spec(np.shape(x), fsdp, expert=expert, stacked=is_stacked(path)))
  return jax.tree_util.tree_map_with_path(spec, tree)


def shard_state(state, mesh: Mesh):
  """A train state (identical in every process: same seed, or the same checkpoint) placed by `tree_shardings`.

  One process: `jax.device_put`. Several: each process fills its own devices' shards from its own copy.
  device_put would first compare every array across the processes (an allgather of the whole model), and it
  does not take PRNG key arrays for a sharding that spans processes; keys travel as their raw data.
  """
  shardings = tree_shardings(state, mesh)
  if jax.process_count() == 1:
    return jax.device_put(state, shardings)

  def put(x, sharding):
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    host = np.asarray(jax.device_get(jax.random.key_data(x) if is_key else x))
    sharding = NamedSharding(mesh, P()) if is_key else sharding  # key data has a trailing axis of its own
    out = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(x)) if is_key else out

  return jax.tree.map(put, state, shardings)


def batch_sharding(mesh: Mesh, shape=None) -> NamedSharding:
  """The batch axis split over ("data", "fsdp"), which is every device without a "seq" axis; on a mesh with
  one, the time axis (axis 1 of `shape`) split over "seq" where its size divides; other axes whole."""
  D = seq_size(mesh)
  if D == 1 or shape is None or len(shape) < 2 or shape[1] % D:
    # A length that "seq" does not divide stays whole here; context_parallel_apply pads it and splits it.
    return NamedSharding(mesh, P(AXES))
  return NamedSharding(mesh, P(AXES, SEQ))


def process_rows(mesh: Mesh, global_batch: int) -> slice:
  """The rows of a global batch of `global_batch` rows that this process's devices hold.

  Read from `batch_sharding(mesh)`, so it is right for any mesh; for a mesh over `jax.devices()` in order
  (devices are numbered process by process) process p of P holds rows [p * B / P, (p + 1) * B / P). One
  process holds every row.
  """
  _check_divisible("the global batch", global_batch, mesh)
  index = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
  spans = sorted((i[0].start or 0, global_batch if i[0].stop is None else i[0].stop) for i in index.values())
  if not spans:
    raise ValueError(f"process {jax.process_index()} holds no device of the mesh {dict(mesh.shape)}")
  # make_array_from_process_local_data also takes a process's rows in pieces, but a data loader wants one range.
  for (_, stop), (start, _) in zip(spans, spans[1:]):
    if start != stop:
      raise ValueError(f"the mesh places process {jax.process_index()}'s devices at batch rows {spans}, not one "
                       "contiguous range; build it over jax.devices() in order")
  return slice(spans[0][0], spans[-1][1])


def _check_divisible(what: str, size: int, mesh: Mesh) -> None:
  n = batch_devices(mesh)
  if size % n:
    raise ValueError(f"{what} has batch size {size}, not a multiple of the {n} devices (data x fsdp) that split "
                     f"the batch on the mesh {dict(mesh.shape)}")


def shard_batch(batch, mesh: Mesh, global_batch: int | None = None):
  """A batch of numpy arrays as global arrays whose batch axis is split over every device of the mesh.

  Args:
    batch: arrays [Bp, ...]: the whole batch (global_batch None or B), or this process's rows
      `process_rows(mesh, global_batch)` of it.
    mesh: the ("data", "fsdp") mesh.
    global_batch: B; None: the rows of `batch`.

  Returns:
    The same dict of arrays [B, ...] sharded by `batch_sharding(mesh, shape)`. One process: `jax.device_put`
    of the whole batch. Several: each process hands over only its own rows (cut from the whole batch if it was
    given one), whole along T, and `jax.make_array_from_process_local_data` assembles the global arrays, so no
    process needs another's rows.
  """
  sizes = {name: np.shape(x)[0] for name, x in batch.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"the arrays of a batch differ in batch size: {sizes}")
  name, rows = next(iter(sizes.items()))
  B = rows if global_batch is None else global_batch
  _check_divisible(f"batch[{name!r}]" if global_batch is None else "the global batch", B, mesh)
  sharded = {name: batch_sharding(mesh, np.shape(x)) for name, x in batch.items()}
  if jax.process_count() == 1:
    if rows != B:
      raise ValueError(f"one process must pass the whole batch of {B} rows, got {rows}")
    return jax.device_put(batch, sharded)
  mine = process_rows(mesh, B)
  if rows == B:
    batch = {name: x[mine] for name, x in batch.items()}
  elif rows != mine.stop - mine.start:
    raise ValueError(f"process {jax.process_index()} holds rows [{mine.start}, {mine.stop}) of the global batch "
                     f"of {B}, got {rows} rows")
  # Axes other than the batch's are whole in every process: each device then takes its slice of T from them.
  return {name: jax.make_array_from_process_local_data(sharded[name], np.asarray(x), (B,) + np.shape(x)[1:])
          for name, x in batch.items()}
