"""Registers, spills and shared memory of `method="pallas"`'s Triton kernels at a shape, on any host (no GPU).

The op is lowered for CUDA with its compiled kernels (not Pallas' interpreter), forward only and forward+backward,
and each kernel is compiled with the installed Triton for sm_90 (the H200) and run through ptxas -v
(`gdn.bench.kernel_resources`). A kernel that spills registers, or whose shared memory is over the H200's 227 KiB a
block, shows here before the card is asked.

  python -m experiments.kernel_resources                                   # B 1, T 256, 2 heads, K = V = 128, bf16
  python -m experiments.kernel_resources --k 256 --v 512                   # the 340M model's heads
  python -m experiments.kernel_resources --k 256 --v 512 --switch ops.pallas_chunk.BWD_STATES=off,on
  python -m experiments.kernel_resources --decode --k 256 --v 512 --decode-block-v 32,64   # the decode-step kernel
  python -m experiments.kernel_resources --batch 8 --length 8192 --conv-channels 6144      # the short conv's kernels
"""

from __future__ import annotations

import argparse

from experiments.cli import apply_setting, setting_label, switch_settings

H200_SHARED = 227 * 1024  # bytes of shared memory a block may use on sm_90


def kernels_of(a) -> list:
  """[(call, TritonKernel)] of the op at the arguments' shape: its forward-only call, then forward+backward."""
  import jax
  import jax.numpy as jnp

  from gdn.bench.kernel_resources import triton_kernels
  from gdn.bench.op_fns import vjp_of
  from gdn.ops import checks, pallas_chunk

  dtype = jnp.dtype(a.dtype)
  B, T, H, K, V = a.batch, a.length, a.heads, a.k, a.v
  shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H) + ((K,) if a.decay == "channel" else ()), (B, T, H)]
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  dims = checks.check_sequence(*args, None, None, None, "pallas", a.chunk)

  def op(q, k, v, g, b):
    return pallas_chunk.pallas(q, k, v, g, b, scale=K**-0.5, initial_state=None, segment_ids=None, dims=dims,
                               chunk_size=a.chunk, interpret=False)[0].astype(dtype)

  out = jax.ShapeDtypeStruct((B, T, H, V), dtype)
  return ([("forward", k) for k in triton_kernels(jax.jit(op), *args)]
          + [("fwd+bwd", k) for k in triton_kernels(jax.jit(vjp_of(op)), out, *args)])


def decode_kernels_of(a, block_v) -> list:
  """[("decode", TritonKernel)] of `pallas_decode.fused_step` for a Gated DeltaNet layer of the arguments' heads
  (q/k and value heads alike, conv window 4, allow_neg_eigval), one token for each of --batch rows; block_v: its
  value step (None: the kernel's default)."""
  import jax
  import jax.numpy as jnp

  from gdn.bench.kernel_resources import triton_kernels
  from gdn.ops import pallas_decode

  dtype, f32 = jnp.dtype(a.dtype), jnp.float32
  B, H, K, V, W = a.batch, a.heads, a.k, a.v, 4
  C = 2 * H * K + H * V  # the conv's channels: q, k, v
  lay = pallas_decode.Layout(H=H, HV=H, K=K, V=V, a=C, b=C + H, gate=C + 2 * H, eps=1e-6, allow_neg_eigval=True)
  S = jax.ShapeDtypeStruct
  args = (S((B, C + 2 * H + H * V), dtype), S((B, W - 1, C), dtype), S((W, C), dtype), None, S((H,), f32),
          S((H,), f32), S((B, H, K, V), f32), S((V,), f32))
  step = jax.jit(lambda *x: pallas_decode.fused_step(*x, layout=lay, interpret=False, block_v=block_v))
  return [("decode", k) for k in triton_kernels(step, *args)]


def conv_kernels_of(a) -> list:
  """[(call, TritonKernel)] of the short conv's kernels (`gdn.layers.conv_kernel`, SiLU, 4 taps) on a [--batch,
  --length, --conv-channels] input, forward only and forward+backward."""
  import jax

  from gdn.bench.kernel_resources import triton_kernels
  from gdn.layers import conv_kernel

  S, dtype, B, T, C = jax.ShapeDtypeStruct, a.dtype, a.batch, a.length, a.conv_channels
  args = (S((B, T, C), dtype), S((B, 3, C), dtype), S((4, C), dtype))
  conv = lambda x, s, w: conv_kernel.short_conv(x, s, w, None, None, "silu", interpret=False)

  def both(x, s, w):
    y, vjp = jax.vjp(conv, x, s, w)
    return vjp(y)

  return ([("forward", k) for k in triton_kernels(jax.jit(conv), *args)]
          + [("fwd+bwd", k) for k in triton_kernels(jax.jit(both), *args)])


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--k", type=int, default=128, help="key dim")
  p.add_argument("--v", type=int, default=128, help="value dim")
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  p.add_argument("--decay", choices=["head", "channel"], default="head", help="per-head g or per-key-channel g")
  p.add_argument("--capability", type=int, default=90, help="the target's compute capability (90: H100/H200)")
  p.add_argument("--switch", action="append", metavar="MODULE.NAME=off,on",
                 help="a module switch under gdn: rows per setting; repeated, per combination")
  p.add_argument("--decode", action="store_true", help="the decode-step kernel (pallas_decode) instead of the op's")
  p.add_argument("--decode-block-v", default="", metavar="BV,...",
                 help="with --decode: the value steps to compile, a row each (0 or none given: the kernel's default)")
  p.add_argument("--conv-channels", type=int, default=0, metavar="C",
                 help="the short conv's kernels (gdn.layers.conv_kernel) on [--batch, --length, C] instead of the op's")
  a = p.parse_args(argv)
  steps = [int(x) or None for x in a.decode_block_v.split(",") if x.strip()] or [None]
  from gdn.bench.kernel_resources import resources

  what = (f"the short conv's kernels for sm_{a.capability}: B {a.batch}, T {a.length}, C {a.conv_channels}, 4 taps, "
          f"SiLU, {a.dtype}" if a.conv_channels else
          f"the decode-step kernel for sm_{a.capability}: B {a.batch}, {a.heads} heads, K {a.k}, V {a.v}, conv 4, "
          f"{a.dtype}" if a.decode else
          f"method='pallas' kernels for sm_{a.capability}: B {a.batch}, T {a.length}, {a.heads} heads, K {a.k}, "
          f"V {a.v}, chunk {a.chunk}, {a.dtype}, {a.decay} decay")
  print(f"# {what} (Triton's own ptxas -v; shared memory over {H200_SHARED // 1024} KiB does not launch on an H200)")
  switch = " setting |" if a.switch else ""
  print(f"|{switch} call | kernel | grid | warps | stages | registers | spill stores B | spill loads B | shared KiB |")
  print("|" + "---|" * (2 + bool(a.switch)) + "---|---:|---:|---:|---:|---:|---:|")
  rows = []
  for setting in switch_settings(a.switch):
    restore = apply_setting(setting)
    try:
      found = (conv_kernels_of(a) if a.conv_channels else
               [(f"{call}, value step {bv or 'default'}", k) for bv in steps for call, k in decode_kernels_of(a, bv)]
               if a.decode else kernels_of(a))
    finally:
      restore()
    for call, kernel in found:
      r = resources(kernel, a.capability)
      over = " (over)" if r["shared"] > H200_SHARED else ""
      cell = f" {setting_label(setting)} |" if a.switch else ""
      print(f"|{cell} {call} | {kernel.name} | {' x '.join(map(str, kernel.grid[:3] if kernel.grid[2] > 1 else kernel.grid[:2]))} | {kernel.num_warps} | "
            f"{kernel.num_stages} | {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | "
            f"{r['shared'] / 1024:.0f}{over} |", flush=True)
      rows.append(dict(setting=setting, call=call, name=kernel.name, grid=kernel.grid, warps=kernel.num_warps,
                       stages=kernel.num_stages, **r))
  return rows


if __name__ == "__main__":
  main()
