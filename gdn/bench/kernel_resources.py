"""What a Pallas (Triton) kernel of gdn needs on an NVIDIA GPU, without one: registers, spills, shared memory.

A jitted function is lowered for CUDA on any host (`lowering_platforms=("cuda",)`); each Pallas kernel becomes a
`__gpu$xla.gpu.triton` custom call whose backend config holds the kernel's Triton IR (MLIR bytecode), its name,
grid, warps and pipeline stages. `triton_kernels` reads those; `resources` turns the bytecode into text with
jaxlib's MLIR (which knows jax's Triton dialect), compiles the text with the installed Triton for the target
(sm_90 by default: the H200), and runs Triton's own ptxas with -v on the PTX: registers a thread, spill stores and
loads, and Triton's shared memory. A kernel that spills or needs more shared memory than the card has is seen
here before any GPU time is spent. The installed Triton need not be the one XLA uses on the card, so the numbers
are a close estimate, not the card's own.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  name: str
  ir: bytes  # MLIR bytecode of jax's Triton dialect
  grid: tuple
  num_warps: int
  num_stages: int


def triton_kernels(jitted, *args) -> list:
  """The Pallas kernels of `jitted(*args)` (a `jax.jit` function) lowered for CUDA, in program order."""
  from jax._src.lib.mlir import ir

  module = jitted.trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if (inner.operation.name == "stablehlo.custom_call"
              and ir.StringAttr(inner.attributes["call_target_name"]).value == "__gpu$xla.gpu.triton"):
            config = inner.attributes["mhlo.backend_config"]
            d = {config[i].name: config[i].attr for i in range(len(config))}
            value = lambda key: ir.IntegerAttr(d[key]).value
            found.append(TritonKernel(ir.StringAttr(d["name"]).value, ir.StringAttr(d["ir"]).value_bytes,
                                      (value("grid_x"), value("grid_y"), value("grid_z")), value("num_warps"),
                                      value("num_stages")))
          walk(inner.operation)

  walk(module.operation)
  return found


def ir_text(kernel: TritonKernel) -> str:
  """The kernel's Triton IR as text (jaxlib's printer; the installed Triton reads text, not jax's bytecode)."""
  from jax._src.lib import triton as jax_triton
  from jax._src.lib.mlir import ir

  with ir.Context():
    jax_triton.dialect.register_dialect(ir.Context.current)
    return str(ir.Module.parse(kernel.ir))


def resources(kernel: TritonKernel, capability: int = 90) -> dict:
  """{registers, spill_stores, spill_loads (bytes), shared (bytes)} of the kernel compiled for sm_<capability> with
  its own warps and stages."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas

  target = GPUTarget("cuda", capability, 32)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{kernel.name}.ttir")
    with open(path, "w") as f:
      f.write(ir_text(kernel))
    compiled = triton.compile(path, target=target, options=dict(num_warps=kernel.num_warps,
                                                                num_stages=kernel.num_stages))
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    run = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", ptx, "-o",
                          os.path.join(tmp, "kernel.o")], capture_output=True, text=True)
  if run.returncode:
    raise RuntimeError(f"ptxas failed on {kernel.name}: {run.stderr.strip()[-400:]}")
  number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, run.stderr)) else 0
  return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
              spill_loads=number(r"(\d+) bytes spill loads"), shared=compiled.metadata.shared)
