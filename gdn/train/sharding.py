"""Sharded training on a named device mesh: data parallelism and FSDP through JAX's own SPMD partitioner.

The mesh has axes ("data", "fsdp"). Batches split their batch axis over both; every parameter (and its
optimizer moments) splits its largest axis that the "fsdp" size divides, the rest is replicated. XLA inserts
the all-gathers and reduce-scatters; one device is the mesh (1, 1) and runs the same code unchanged.
Several hosts: call `jax.distributed.initialize()` first (see docs/scaling.md), then build the mesh over
`jax.devices()` as here.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
  """A ("data", "fsdp") mesh over `devices` (default all); data = -1 takes what fsdp leaves."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if fsdp < 1 or n % fsdp:
    raise ValueError(f"fsdp must be a positive divisor of the device count {n}, got {fsdp}")
  if data == -1:
    data = n // fsdp
  if data < 1 or data * fsdp != n:
    raise ValueError(f"data * fsdp must equal the device count {n}, got data={data}, fsdp={fsdp}")
  return Mesh(np.array(devices).reshape(data, fsdp), AXES)


def param_spec(shape, fsdp_size: int) -> P:
  """Shard the largest axis that fsdp_size divides (ties: the first), or replicate."""
  if fsdp_size == 1 or not shape:
    return P()
  for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % fsdp_size == 0:
      return P(*[("fsdp" if a == axis else None) for a in range(len(shape))])
  return P()


def tree_shardings(tree, mesh: Mesh):
  """NamedShardings for every array leaf of a train state (scalars and small leaves replicated)."""
  fsdp = mesh.shape["fsdp"]
  return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(np.shape(x), fsdp)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """The batch axis split over every device of the mesh; other axes whole."""
  return NamedSharding(mesh, P(AXES))


def shard_batch(batch, mesh: Mesh):
  size = mesh.size
  for name, x in batch.items():
    if np.shape(x)[0] % size:
      raise ValueError(f"batch[{name!r}] has batch size {np.shape(x)[0]}, not a multiple of the {size} devices "
                       f"of the mesh {dict(mesh.shape)}")
  return jax.device_put(batch, batch_sharding(mesh))
