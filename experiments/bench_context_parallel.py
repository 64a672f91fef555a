"""Context-parallel gated delta rule: forward + backward time and memory per device vs sequence length, on one
device and on all devices (the time axis split over them).

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim, D devices.

  python experiments/bench_context_parallel.py --cpu-devices 8 --lengths 1024,4096   # CPU, for correctness
  python experiments/bench_context_parallel.py --lengths 8192,32768,131072          # every GPU of the host

Memory is XLA's compiled estimate per device (arguments + outputs + temporaries), which is what decides
whether a length fits; where the backend reports it, the allocator's peak is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="run on this many forced host CPU devices (0: use the default backend's devices)")
  p.add_argument("--devices", type=int, default=0, help="devices on the sequence axis (0: all)")
  p.add_argument("--lengths", default="1024,2048,4096", help="comma-separated sequence lengths T")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4, help="H = HV")
  p.add_argument("--key-dim", type=int, default=64)
  p.add_argument("--value-dim", type=int, default=64)
  p.add_argument("--method", default="chunk", choices=("chunk", "associative"))
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--max-single", type=int, default=0,
                 help="skip the one-device run above this T (0: never), e.g. where it does not fit")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.cpu_devices:
    # Must happen before jax initialises its backends.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from gdn import ops
  from gdn.bench.timing import compiled_bytes

  devices = jax.devices()
  D = args.devices or len(devices)
  if D > len(devices):
    sys.exit(f"--devices {D} asks for more than the {len(devices)} devices present")
  mesh = Mesh(np.array(devices[:D]), ("seq",))
  B, H, K, V = args.batch, args.heads, args.key_dim, args.value_dim
  dtype = jnp.dtype(args.dtype)

  def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=rng.normal(size=(B, T, H, K)).astype(dtype), k=k.astype(dtype),
                v=rng.normal(size=(B, T, H, V)).astype(dtype),
                g=np.log(rng.uniform(0.9, 1.0, (B, T, H))).astype(np.float32),
                beta=rng.uniform(0, 1, (B, T, H)).astype(np.float32))

  def loss_and_grads(f):
    def loss(x):
      o, S = f(**x)
      return jnp.mean(jnp.square(o.astype(jnp.float32))) + jnp.mean(jnp.square(S))
    return jax.jit(jax.value_and_grad(loss))

  single = loss_and_grads(lambda **x: ops.gated_delta_rule(**x, method=args.method, chunk_size=args.chunk_size))
  parallel = loss_and_grads(lambda **x: ops.context_parallel_gated_delta_rule(
      **x, mesh=mesh, axis_name="seq", method=args.method, chunk_size=args.chunk_size))

  def measure(fn, x):
    """(median seconds, compiled MiB per device, allocator peak MiB or None)."""
    compiled = fn.lower(x).compile()
    est = compiled_bytes(compiled)
    est = None if est is None else est / 2**20
    jax.block_until_ready(compiled(x))
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(x))
      times.append(time.perf_counter() - t0)
    stats = [d.memory_stats() for d in devices[:D]]
    peak = max((s or {}).get("peak_bytes_in_use", 0) for s in stats) / 2**20 or None
    return statistics.median(times), est, peak

  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  print(f"# {jax.default_backend()} x{D} ({devices[0].device_kind}); B={B} H=HV={H} K={K} V={V} "
        f"{args.dtype} method={args.method} C={args.chunk_size}; forward + backward, median of {args.repeats}")
  print(f"{'T':>8} {'1 dev ms':>10} {f'{D} dev ms':>10} {'speed-up':>8} {'tok/s (D)':>11} "
        f"{'1 dev MiB':>10} {'MiB/dev':>9} {'peak MiB':>9}")
  for T in [int(t) for t in args.lengths.split(",")]:
    x = inputs(T)
    t1 = m1 = None
    if not args.max_single or T <= args.max_single:
      try:
        t1, m1, _ = measure(single, jax.device_put(x, devices[0]))
      except Exception as e:  # noqa: BLE001  (out of memory on one device is a result, not a failure)
        print(f"{T:>8} one device failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    # Committed inputs: the host CPU runtime has deadlocked in the first collective when an executable was
    # called with host (uncommitted) arrays.
    split = PartitionSpec(None, "seq") if T % D == 0 else PartitionSpec()
    tD, mD, peak = measure(parallel, jax.device_put(x, NamedSharding(mesh, split)))
    speedup = None if t1 is None else t1 / tD
    print(f"{T:>8} {fmt(t1 and t1 * 1e3, '10.1f')} {tD * 1e3:>10.1f} {fmt(speedup, '8.2f')} "
          f"{B * T / tD:>11.3g} {fmt(m1, '10.1f')} {fmt(mD, '9.1f')} {fmt(peak, '9.1f')}")


if __name__ == "__main__":
  main()
