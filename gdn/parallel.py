"""Context parallelism for whole models: the time axis of one long sequence split over a mesh axis.

Shapes: B batch, T time, D devices on the sequence axis, L = T / D time steps per device, Vocab vocabulary size.

All layers run inside one `shard_map` over the sequence axis, each device on its slice [B, L] of the tokens,
with the parameters replicated. Per-token layers (embedding, norms, MLPs, head) need nothing from other
devices; the three that mix across time each exchange what they need (docs/context_parallel.md):
  recurrent mixers   `gdn.ops.context_parallel.local_gated_delta_rule`: all-gather of per-device state maps;
  short convs        the previous device's last W - 1 inputs (a `ppermute`; zeros on the first device);
  attention          all-gather of keys and values; each device keeps its queries, masked by global position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from gdn.model import LanguageModel
from gdn.ops.context_parallel import check_mesh_axes, place

try:  # jax >= 0.7 exposes shard_map at the top level; older releases only in jax.experimental
  from jax import shard_map as _shard_map
except ImportError:  # pragma: no cover
  from jax.experimental.shard_map import shard_map as _shard_map


def context_parallel_apply(model: LanguageModel, tokens, mesh, *, axis_name: str = "seq",
                           batch_axis_name=None, segment_ids=None):
  """`model(tokens, segment_ids=segment_ids)` with the time axis split over the mesh axis `axis_name`: the same
  logits as one device, and differentiable (under `jax.grad` / `nnx.grad` the parameters' gradients are summed
  over the devices, the transpose of their replication).

  T need not be a multiple of D: the tokens are padded at their end, which no earlier position sees (every layer
  is causal), and the padding is cut from the logits. Each device's slice needs at least conv_size - 1 steps.

  Args:
    model: a `LanguageModel` without active dropout.
    tokens: int [B, T]. segment_ids: None or int [B, T] (packed sequences; a segment may span slices).
    mesh: a `jax.sharding.Mesh` with the axis `axis_name`; batch_axis_name: None, another of its axes or a
      tuple of them (("data", "fsdp") in training), over which the batch is split as well (data parallelism
      beside context parallelism).
  Returns:
    logits float32 [B, T, Vocab], split over `axis_name` along T where D divides T (and over batch_axis_name
    along B).
  Raises:
    ValueError: an axis missing from the mesh, B not a multiple of the batch axis, active dropout (a replicated
      key would draw the same mask for every slice), or a mixer the context-parallel op declines (per-value-
      channel beta). TypeError: a model that is not a `LanguageModel`.
  """
  if not isinstance(model, LanguageModel):
    raise TypeError(f"model must be a gdn.model.LanguageModel, got {type(model).__name__}")
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, T], got shape {tokens.shape} and dtype {tokens.dtype}")
  B, T = tokens.shape
  if segment_ids is not None and segment_ids.shape != (B, T):
    raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
  D = check_mesh_axes(mesh, axis_name, batch_axis_name, B)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, nnx.Dropout) and m.rate > 0 and not m.deterministic:
      raise ValueError("context parallelism does not support active dropout (each device would draw its "
                       "slice's mask from the same key); call model.eval() or set dropout=0")

  pad = -(-T // D) * D - T
  if pad:
    tokens = jnp.pad(tokens, [(0, 0), (0, pad)])
    if segment_ids is not None:
      segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
  graphdef, state = nnx.split(model)
  seq, rows, replicated = PartitionSpec(batch_axis_name, axis_name), PartitionSpec(batch_axis_name), PartitionSpec()
  args = (jax.tree.map(lambda x: place(x, mesh, replicated), state), place(tokens, mesh, seq))
  specs = (replicated, seq)
  if segment_ids is not None:
    args, specs = args + (place(segment_ids, mesh, seq),), specs + (seq,)

  def body(state, tokens, segment_ids=None):
    return nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids, context_axis=axis_name)

  logits = _shard_map(body, mesh=mesh, in_specs=specs, out_specs=seq)(*args)
  if pad:
    # An Explicit axis cannot split the unpadded length evenly: the cut logits are not split over time.
    logits = place(logits, mesh, rows)
  return logits[:, :T]
