"""The short convolution (`gdn.layers.conv.ShortConv`, kernel 4, SiLU) alone: forward and forward+backward time
per module-switch setting, beside the floor of its memory traffic.

The profile of the 340M model's training step puts the conv's backward at 9.5% of the step (2.4 ms a layer at
8 x 4096 tokens and 6,144 channels: q, k and v convolved as one), about ten times the time its bytes take, so
its implementations are compared here on their own: JAX's autodiff of the shifted taps (the default),
`CONV_VJP` (the conv's own VJP) and `CONV_LAX` (one depthwise `lax.conv_general_dilated`, cuDNN on a GPU).

Shapes are (B, T, C). The floor is bytes / the card's copy rate (`gdn.bench.roofline.H200_PEAKS`): the forward
reads x and writes y; forward+backward also reads x and y's cotangent and writes x's (the weight's few bytes
left out). On CPU the times only check that the script runs.

  python -m experiments.bench_conv                                    # the two model shapes, bfloat16
  python -m experiments.bench_conv --shapes 2,256,96 --reps 2         # a quick run
  python -m experiments.bench_conv --switch layers.conv.CONV_VJP=off,on    # the conv's own VJP instead
  # the Pallas kernels' blocks, a row each (one command):
  python -m experiments.bench_conv --shapes 8,4096,6144 --switch layers.conv.CONV_KERNEL=on
      --switch layers.conv_kernel.BLOCK_T=16,32,64 --switch layers.conv_kernel.BLOCK_C=32,64,128
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.cli import apply_setting, setting_label, switch_settings
from gdn.bench.roofline import H200_PEAKS
from gdn.bench.timing import compiled_bytes, timed
from gdn.layers.conv import ShortConv

# (B, T, C): the 340M config's step (8 x 4096 tokens, 6 heads x (256 + 256 + 512) channels) and the layer
# benchmark's (8 x 8192 tokens, 16 heads x 3 x 128 channels at d_model 2048).
SHAPES = ("8,4096,6144", "8,8192,6144")


def parse_shape(text: str) -> tuple:
  parts = tuple(int(s) for s in text.split(","))
  if len(parts) != 3 or min(parts) < 1:
    raise argparse.ArgumentTypeError(f"a shape is B,T,C with positive ints, got {text!r}")
  return parts


def programs(shape, dtype, size: int = 4):
  """(forward, forward+backward) jitted functions of (params, x, dy), and their arguments: y = SiLU(conv(x)),
  and the gradients of sum(y * dy) with respect to the weight and x."""
  B, T, C = shape
  conv = ShortConv(C, size, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(conv, nnx.Param)
  keys = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(keys[0], (B, T, C), dtype)
  dy = jax.random.normal(keys[1], (B, T, C), dtype)

  def forward(params, x):
    return nnx.merge(graphdef, params)(x, activation="silu")[0]

  def loss(params, x, dy):
    return jnp.sum((forward(params, x) * dy).astype(jnp.float32))

  fwd = jax.jit(forward)
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return fwd, fwd_bwd, (params, x, dy)


def measure(shape, dtype, reps: int) -> dict:
  """Median ms of both programs (traced now: the switches in force are those set by the caller) and XLA's
  estimate of the forward+backward's bytes."""
  fwd, fwd_bwd, (params, x, dy) = programs(shape, dtype)
  est = compiled_bytes(fwd_bwd.lower(params, x, dy).compile())
  return dict(fwd=timed(fwd, (params, x), reps), fwd_bwd=timed(fwd_bwd, (params, x, dy), reps),
              xla_mib=None if est is None else est / 2**20)


def floors_ms(shape, itemsize: int) -> tuple:
  """(forward, forward+backward) floor in ms: 2 and 5 arrays of B T C moved at the card's copy rate."""
  n = shape[0] * shape[1] * shape[2] * itemsize
  ms = lambda arrays: 1e3 * arrays * n / (H200_PEAKS["tbps"] * 1e12)
  return ms(2), ms(5)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES],
                 help="B,T,C per shape (default: the 340M step's and the layer benchmark's)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--switch", action="append", default=None,
                 help="MODULE.NAME=a,b under gdn, repeatable: a row per combination (default: "
                      "layers.conv.CONV_LAX=off,on)")
  args = p.parse_args(argv)
  specs = args.switch or ["layers.conv.CONV_LAX=off,on"]
  settings = switch_settings(specs)
  dtype = jnp.dtype(args.dtype)
  dev = jax.devices()[0]
  print(f"# short conv (kernel 4, SiLU), {dev.device_kind} ({dev.platform}), jax {jax.__version__}, {args.dtype}, "
        f"median of {args.reps}; floor: bytes at {H200_PEAKS['tbps']} TB/s")
  print("| B, T, C | setting | fwd ms | fwd+bwd ms | fwd floor ms | fwd+bwd floor ms | fwd+bwd / floor | "
        "XLA estimate MiB |")
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  rows = []
  for shape in args.shapes:
    f_floor, fb_floor = floors_ms(shape, dtype.itemsize)
    for setting in settings:
      restore = apply_setting(setting)
      try:
        r = measure(shape, dtype, args.reps)
      finally:
        restore()
      est = "-" if r["xla_mib"] is None else f"{r['xla_mib']:,.0f}"
      print(f"| {', '.join(map(str, shape))} | {setting_label(setting)} | {r['fwd']:.3f} | {r['fwd_bwd']:.3f} | "
            f"{f_floor:.3f} | {fb_floor:.3f} | {r['fwd_bwd'] / fb_floor:.1f}x | {est} |", flush=True)
      rows.append(dict(shape=shape, setting=setting, **r))
  return rows


if __name__ == "__main__":
  main()
