"""Conventions every Pallas (Triton) kernel of `gdn.ops` shares: block sizes, where kernels run, dot precision, and
how a kernel call is partitioned over devices and batched under `jax.vmap`.

A kernel call is one custom call that XLA's partitioner cannot split: under a multi-device `jax.jit` it would
gather every operand onto every device and run the whole call there. Every kernel here works on independent rows
(a chunk, a sub-chunk, a (batch, head) pair) that lead all its operands and results, so `per_rows` makes the call
a `custom_partitioning` op that keeps the sharding of those leading axes and runs the call on each device's own
rows; `batched_rows` gives such an op the batching rule `custom_partitioning` lacks.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def pow2(n: int, least: int = 16) -> int:
  """Triton needs power-of-two block shapes, and at least 16 along every dot dimension."""
  return max(least, 1 << max(0, n - 1).bit_length())


def default_interpret() -> bool:
  """Compiled Triton kernels on a GPU backend; Pallas' interpreter elsewhere (CPU CI runs the same kernels)."""
  return jax.default_backend() != "gpu"


def kernel_precision(prec, interpret: bool):
  """The dot precision inside the kernels. Compiled, a float32 caller's HIGHEST becomes 3xTF32 (three TF32
  tensor-core products, float32 accumulation, about float32 accuracy): Triton lowers HIGHEST to IEEE float32
  dots without tensor cores, which spill heavily at K = 128. DEFAULT (bfloat16 callers) is one TF32 product
  on float32 operands, as XLA does it. The interpreter keeps `prec`: XLA:CPU has no TF32 algorithms."""
  if not interpret and prec == jax.lax.Precision.HIGHEST:
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return prec


def _row_shardings(arg_shapes, result_shape, lead: int):
  """Every operand and result sharded as the first operand's `lead` leading axes, all other axes whole."""
  first = jax.tree.leaves(arg_shapes)[0].sharding
  if not isinstance(first, NamedSharding):  # JAX names the axes only where it knows the mesh
    raise NotImplementedError(f"the Pallas kernels partition over a named mesh: shard their inputs with "
                              f"NamedSharding (got {first})")
  spec = (tuple(first.spec) + (None,) * lead)[:lead]
  rows = lambda a: NamedSharding(first.mesh, PartitionSpec(*spec, *([None] * (len(a.shape) - lead))))
  return jax.tree.map(rows, arg_shapes), jax.tree.map(rows, result_shape)


def _whole_rule(*args):
  """The Shardy rule of a `per_rows` op without a written one: the factor r shared by every operand's and
  result's first axis, a factor of its own (kept whole) for each other axis. args: (*static, mesh, operand types,
  result types), as `custom_partitioning` calls a rule."""
  operands, results = args[-2:]
  names = (f"x{i}" for i in itertools.count())
  mapping = lambda t: " ".join(["r"] + [next(names) for _ in range(len(t.shape) - 1)])
  ins, outs = ", ".join(map(mapping, operands)), ", ".join(map(mapping, results))
  whole = tuple(f for f in f"{ins} {outs}".replace(",", " ").split() if f != "r")
  return f"{ins} -> {outs}", {"need_replication_factors": whole}


def per_rows(fn, rule: str | None = None, lead: int = 1):
  """`fn(static, *arrays)` as a `custom_partitioning` op that runs on each device's block of rows.

  Every operand and result (pytrees, None leaves allowed) leads with the same `lead` row axes, and each row is
  independent, so a sharding of those axes is kept and the per-device function is `fn` itself on the local
  block; every other axis must be whole on every device. `rule` is the Shardy form, its row factors named b h
  for `lead` 2 (the others kept whole); None (for `lead` 1): r and a whole factor for each other axis. The two
  callbacks serve the GSPMD partitioner."""
  op = custom_partitioning(fn, static_argnums=(0,))

  def partition(static, mesh, arg_shapes, result_shape):
    arg_shardings, result_shardings = _row_shardings(arg_shapes, result_shape, lead)
    return mesh, functools.partial(fn, static), result_shardings, arg_shardings

  def infer_sharding_from_operands(static, mesh, arg_shapes, result_shape):
    return _row_shardings(arg_shapes, result_shape, lead)[1]

  if rule is None:
    if lead != 1:
      raise ValueError(f"per_rows: a rule written out is needed for {lead} row axes")
    op.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                     sharding_rule=_whole_rule)
    return op
  # Shardy wants the special factors in the order the rule first names them.
  whole = tuple(dict.fromkeys(f for f in rule.replace(",", " ").split() if f not in ("b", "h", "->")))
  op.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                   sharding_rule=rule, need_replication_factors=whole)
  return op


def batched_rows(op, static, *arrays):
  """`op(static, *arrays)` with a batching rule: `custom_partitioning` has none, so under `jax.vmap` (e.g. sweep
  cells stacked by `gdn.train.train_stacked`) the mapped axis is folded into the first row axis, which every
  operand and result leads with, and unfolded from the results. Unmapped operands are broadcast first."""

  @jax.custom_batching.custom_vmap
  def call(*xs):
    return op(static, *xs)

  @call.def_vmap
  def rule(axis_size, in_batched, *xs):
    def fold(x, mapped):
      x = x if mapped else jnp.broadcast_to(x, (axis_size,) + x.shape)
      return x.reshape((axis_size * x.shape[1],) + x.shape[2:])

    out = call(*jax.tree.map(fold, xs, tuple(in_batched)))
    out = jax.tree.map(lambda y: y.reshape((axis_size, y.shape[0] // axis_size) + y.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)

  return call(*arrays)
