"""Several projections of one input as one matmul, for inference.

Shapes: D input features, N_i the i-th projection's outputs, N their sum; kernels may carry leading axes (the
layer axis G of a scanned model), which the matmul never sees (the scan slices them off first).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.ops import pallas_matvec

# A matmul of one input row computed on two (the row and a zero row, the second output dropped), where its
# weight has fewer than STRENGTH_REDUCED elements: True always, False never, None (auto, the default) on a GPU
# only. Timed on the H200 (`bench_decode --switch layers.fused.PAD_SINGLE_ROW=off,auto`) in two calls it took a
# batch-1 step from 0.859 to 0.837 ms and from 0.874 to 0.832 ms and left batch 8 as it was (0.790, 0.789 ms;
# results/benchmarks/h200_2026-12-03/decode_pad_matvec.txt, decode_pad_confirm.txt), hence auto. Why it was built: at
# batch 1 a decode step's input is a vector, and XLA's GPU algebraic simplifier rewrites a dot of a vector and a
# matrix of under 10M elements in all (ShouldStrengthReduceDotToReduce, a constant of XLA's, not an option)
# as a multiply and a reduction, which writes the whole product matrix and reads it back. On the H200 that made
# the 2048 x 2048 output projection of a decode step take 12 us a layer where a GEMM at batch 8 takes 4.6
# (results/benchmarks/h200_2026-12-03/decode_profile.txt). A dot of two rows is a matrix product, left a GEMM.
PAD_SINGLE_ROW = None
STRENGTH_REDUCED = 10_000_000


def pads_single_row(rows: int, kernel_shape) -> bool:
  """Whether a matmul of `rows` input rows and a kernel of `kernel_shape` runs on a padded second row (read at
  trace time: see PAD_SINGLE_ROW)."""
  on = jax.default_backend() == "gpu" if PAD_SINGLE_ROW is None else bool(PAD_SINGLE_ROW)
  return on and rows == 1 and math.prod(kernel_shape) + kernel_shape[0] < STRENGTH_REDUCED


class FusedLinear(nnx.Module):
  """y = x [W_1 | W_2 | ...] (+ [b_1 | b_2 | ...]), returned split as {name: y_i}, each piece what the named
  `nnx.Linear` gives: its columns are the same dot products, in the same dtype, and a missing bias is a zero.

  Why: at batch 1 a decode step is a chain of small kernels; the q, k, v, decay, beta and gate projections of a
  recurrent layer read the same x, so one matmul reads the same weights with one launch instead of six.
  """

  def __init__(self, linears: dict):
    ls = list(linears.values())
    for name in ("dtype", "precision", "dot_general", "preferred_element_type"):
      if len({id(getattr(l, name)) if name == "dot_general" else getattr(l, name) for l in ls}) != 1:
        raise ValueError(f"the projections to fuse must share {name}")
    l0 = ls[0]
    self.names = tuple(linears)
    self.sizes = tuple(l.kernel.shape[-1] for l in ls)
    self.dtype, self.precision, self.preferred_element_type = l0.dtype, l0.precision, l0.preferred_element_type
    self.dot_general = l0.dot_general
    self.kernel = nnx.Param(jnp.concatenate([l.kernel[...] for l in ls], axis=-1))
    if all(l.bias is None for l in ls):
      self.bias = None
    else:
      zero = lambda l: jnp.zeros(l.kernel.shape[:-2] + l.kernel.shape[-1:], l.kernel.dtype)
      self.bias = nnx.Param(jnp.concatenate([zero(l) if l.bias is None else l.bias[...] for l in ls], axis=-1))

  def __call__(self, x) -> dict:
    return dict(zip(self.names, jnp.split(self.matmul(x), np.cumsum(self.sizes)[:-1].tolist(), axis=-1)))

  def offsets(self) -> dict:
    """{name: (first column, columns)} of each projection in `matmul`'s output."""
    starts = np.cumsum((0,) + self.sizes[:-1]).tolist()
    return {n: (o, s) for n, o, s in zip(self.names, starts, self.sizes)}

  def matmul(self, x):
    """All the columns unsplit, [..., N] (for a consumer that reads the pieces at their `offsets`). At most
    `pallas_matvec.ROWS` rows of a 16-bit model go through `gdn.ops.pallas_matvec` where MATVEC_KERNEL asks for
    it and the kernel takes the shape; one row, where PAD_SINGLE_ROW asks, through a dot of two rows."""
    # nnx.Linear's computation, once for all the columns.
    kernel = self.kernel[...]
    bias = None if self.bias is None else self.bias[...]
    x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
    kw = {} if self.preferred_element_type is None else dict(preferred_element_type=self.preferred_element_type)
    lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
    if (pallas_matvec.enabled() and self.preferred_element_type is None and x.dtype == kernel.dtype
        and kernel.ndim == 2 and pallas_matvec.plan(rows, *kernel.shape, kernel.dtype) is not None):
      # A few rows of a 16-bit model: the weight-streaming kernel (gdn.ops.pallas_matvec).
      y = pallas_matvec.matvec(x.reshape(rows, x.shape[-1]), kernel).reshape(lead + kernel.shape[-1:])
    elif pads_single_row(rows, kernel.shape):
      x2 = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
      y2 = self.dot_general(x2, kernel, (((1,), (0,)), ((), ())), precision=self.precision, **kw)
      y = y2[:1].reshape(lead + kernel.shape[-1:])
    else:
      y = self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision, **kw)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class LeanLinear(FusedLinear):
  """One `nnx.Linear` as a FusedLinear of one projection: the same output array (not a dict), with the
  inference matmul's handling of a few input rows (`gdn.ops.pallas_matvec.MATVEC_KERNEL`, PAD_SINGLE_ROW). For
  the projections that `for_decoding` does not fuse with others (a layer's output projection, an MLP's down
  projection)."""

  def __init__(self, linear: nnx.Linear):
    super().__init__({"y": linear})

  def __call__(self, x):
    return self.matmul(x)


def lean(linear):
  """`linear` as a LeanLinear (in place of an nnx.Linear; one already lean, or None, as it is)."""
  return LeanLinear(linear) if isinstance(linear, nnx.Linear) else linear


def project(module: nnx.Module, names: tuple, x) -> dict:
  """{name: projection of x} for the named `nnx.Linear` attributes of `module` that are not None: through its
  `in_proj` (a FusedLinear) once `fuse_projections` has run, else one Linear at a time."""
  if module.in_proj is not None:
    return module.in_proj(x)
  return {n: getattr(module, n)(x) for n in names if getattr(module, n) is not None}


def fuse_projections(module: nnx.Module, names: tuple):
  """Replace the named Linear attributes of `module` (those not None) by one FusedLinear `module.in_proj`, in
  place. The separate ones are dropped, so that the weights are held once: the module then computes the same
  outputs, but its parameters no longer have the layout of checkpoints, `stack_layers` or the interop loaders."""
  if module.in_proj is not None:
    return
  linears = {n: getattr(module, n) for n in names if getattr(module, n) is not None}
  if len(linears) < 2:
    return
  module.in_proj = nnx.data(FusedLinear(linears))
  for n in linears:
    setattr(module, n, None)
