"""Sharded training throughput vs device count: the jitted train step of gdn/train/step.py on a ("data", "fsdp")
mesh over the first n devices, for n = 1, 2, 4, ..., all.

  # CPU, 8 forced devices, tiny model: checks that it runs and that the losses match
  python experiments/bench_scaling.py --cpu-devices 8 --method recurrent --d-model 32 --layers 2 --pattern RA \
      --seq-len 32
  # every GPU of the host; add --fsdp n to split parameters and optimizer state over all n devices
  python experiments/bench_scaling.py --d-model 1024 --layers 8 --seq-len 4096 --per-device-batch 8 \
      --dtype bfloat16
  # context parallelism: each 32K-token sequence split over 2 GPUs, against one GPU holding it whole
  python experiments/bench_scaling.py --devices 1,2 --seq 2 --d-model 1024 --layers 24 --pattern R --vocab 32000 \
      --seq-len 32768 --per-device-batch 1 --dtype bfloat16 --method pallas --override model.remat=dots \
      --override model.scan_layers=True

Every n gets the same per-device batch, so the global batch grows with n (weak scaling) and perfect scaling
keeps tokens/s per device constant. With --seq k, every device count that k divides splits the time axis of each
sequence over k devices (a ("data", "fsdp", "seq") mesh: `config.train.mesh_seq`, context parallelism), so k
devices share each row of the per-device batch and the global batch is n / k of them; a count k does not divide
(1, the reference) holds whole sequences. The batches are random tokens from a numpy generator seeded the same way
for every n (a throughput benchmark needs no task: the token values do not change the work); the targets are
the inputs shifted by one. The model is the configs' own (configs/base.py: `mixer()` and `width()` applied to
the base config), so a benchmarked model is one that `gdn-train` can run. One process: several hosts are not
benchmarked here.

Columns. step ms: median of --steps timed steps after --warmup steps (the first one compiles), each blocked
on until the new state and the metrics are ready. tokens/s: global batch x seq len / step time. efficiency:
tokens/s per device over that of the first device count (1 unless --devices says otherwise). loss rel diff:
the loss of the first step on n devices against one device's loss on the same global batch (the forward at
the initial parameters with dropout off, as the configs have it, summed over pieces of the per-device batch
so that it fits on one device); in float32 a sharded step matches to rounding. peak MiB/dev: the allocator's
peak from `device.memory_stats()` where the backend reports one (GPUs, not the CPU); the peak is never
reset, so it is read from the devices that this n uses for the first time (the devices of one SPMD step do
the same work). compiled MiB/dev: XLA's estimate for the step (arguments + outputs + temporaries - donated
buffers), on any backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="run on this many forced host CPU devices (0: use the default backend's devices)")
  p.add_argument("--devices", default="", help="comma-separated device counts (default 1, 2, 4, ..., all)")
  p.add_argument("--fsdp", default="1", help="devices on the fsdp axis: 1 (pure data parallel), n (all), or k")
  p.add_argument("--seq", type=int, default=1,
                 help="devices on the seq axis (context parallelism) for the device counts it divides")
  p.add_argument("--mixer", default="gated_deltanet",
                 help="attention or a recurrent preset of gdn.config.PRESETS (gated_deltanet, kda, ...)")
  p.add_argument("--pattern", default="RRRA", help="layer pattern (R recurrent, A attention, W sliding window)")
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=0, help="heads of every mixer (0: d_model // 128, at least 2)")
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--per-device-batch", type=int, default=2)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
  # "auto" picks the recurrent form from the global batch, which grows with n: one fixed method keeps the work
  # per device the same at every n.
  p.add_argument("--method", default="chunk", choices=("auto", "recurrent", "chunk", "associative", "pallas"))
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                 help="any other config key, e.g. model.recurrent.num_v_heads=8 (repeatable)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first of which compiles")
  p.add_argument("--steps", type=int, default=5, help="timed steps")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.seq < 1:
    p.error(f"--seq must be at least 1, got {args.seq}")
  if args.warmup < 1 or args.steps < 1:
    p.error("--warmup and --steps must be at least 1 (the first warm-up step gives the loss that is checked)")
  return args


def experiment_config(args):
  """The ExperimentConfig of the benchmarked model, built as the config files build theirs."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from configs import base
  from gdn.train.config import from_dict

  heads = args.heads or max(2, args.d_model // 128)
  c = base.get_config()
  base.apply(c, base.width(args.d_model, heads) + base.mixer(args.mixer, pattern=args.pattern) + (
      f"model.num_layers={args.layers}", f"model.vocab_size={args.vocab}", f"model.dtype={args.dtype}",
      f"model.recurrent.method={args.method}", f"model.recurrent.chunk_size={args.chunk_size}",
      *args.override))
  return from_dict(c.to_dict())


def device_counts(spec: str, available: int) -> list:
  if spec:
    counts = [int(n) for n in spec.split(",")]
  else:
    counts = [n for n in (2**i for i in range(available.bit_length())) if n <= available]
    counts += [available] if counts[-1] != available else []
  bad = [n for n in counts if not 1 <= n <= available]
  if bad:
    sys.exit(f"--devices {bad}: only {available} devices are present")
  return counts


def fsdp_size(spec: str, n: int) -> int:
  k = n if spec == "n" else min(int(spec), n)
  if n % k:
    sys.exit(f"--fsdp {spec}: {k} does not divide the device count {n}")
  return k


def seq_size(k: int, n: int, fsdp: int) -> int:
  """Devices on the seq axis at n devices: k where k fsdp divides n, else 1 (whole sequences)."""
  return k if n % (k * fsdp) == 0 else 1


def main(argv=None) -> list:
  """Prints the table; returns its rows as dicts."""
  args = parse_args(argv)
  if args.cpu_devices:
    # Must happen before jax initialises its backends.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import numpy as np

  from gdn.bench.timing import compiled_bytes
  from gdn.train import optimizer, sharding, step

  cfg = experiment_config(args)
  tx = optimizer.make_optimizer(cfg.train)
  graphdef, abstract = jax.eval_shape(lambda: step.init(cfg.model, tx, cfg.seed))
  eval_step = step.make_eval_step(graphdef, loss_chunk=cfg.train.loss_chunk)
  init_state = lambda: step.init(cfg.model, tx, cfg.seed)[1]
  init_on_one = jax.jit(init_state)  # on devices[0]
  devices = jax.devices()
  b, T = args.per_device_batch, args.seq_len

  def batch_of(B):
    """Random tokens [B, T + 1] from a generator seeded the same for every n: inputs, next-token targets."""
    tokens = np.random.default_rng(args.seed).integers(0, cfg.model.vocab_size, size=(B, T + 1)).astype(np.int32)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], weights=np.ones((B, T), np.float32))

  def one_device_loss(batch):
    """The train step's first loss (nll / weight at the initial parameters) on one device, b rows at a time."""
    state = init_on_one()
    nll = weight = 0.0
    for i in range(0, len(batch["inputs"]), b):
      stats = jax.device_get(eval_step(state.params, state.rest, {k: x[i:i + b] for k, x in batch.items()}))
      nll, weight = nll + float(stats["nll"]), weight + float(stats["weight"])
    return nll / max(weight, 1.0)

  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  m = cfg.model
  print(f"# {jax.default_backend()} x{len(devices)} ({devices[0].device_kind}); {args.mixer} {m.pattern} "
        f"d_model={m.d_model} layers={m.num_layers} heads={m.recurrent.num_heads} "
        f"vocab={m.vocab_size} {m.dtype} method={m.recurrent.method}; {b} x {T} tokens per device"
        + (f" (each row's {T} split over the seq axis where it has {args.seq} devices)" if args.seq > 1 else "") + "; "
        f"{args.warmup} warm-up steps, median of {args.steps}")
  print("| devices | mesh (data x fsdp x seq) | global batch | step ms | tokens/s | tokens/s/device | efficiency "
        "| loss rel diff | peak MiB/dev | compiled MiB/dev |")
  print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  rows, used, base = [], set(), None
  for n in device_counts(args.devices, len(devices)):
    fsdp = fsdp_size(args.fsdp, n)
    seq = seq_size(args.seq, n, fsdp)
    mesh = sharding.make_mesh(data=n // (fsdp * seq), fsdp=fsdp, devices=devices[:n], seq=seq)
    B = n // seq * b
    host_batch = batch_of(B)
    # Made directly in its shards: no device ever holds the whole state unless the mesh says so.
    state = jax.jit(init_state, out_shardings=sharding.tree_shardings(abstract, mesh))()
    batch = sharding.shard_batch(host_batch, mesh)
    train_step = step.make_train_step(graphdef, tx, optimizer.lr_shape(cfg.train), mesh=mesh,
                                      loss_chunk=cfg.train.loss_chunk)
    compiled = train_step.lower(state, batch).compile()
    est = compiled_bytes(compiled)
    est = None if est is None else est / 2**20
    state, metrics = compiled(state, batch)
    first_loss = float(metrics["loss"])
    for _ in range(args.warmup - 1):
      state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - t0)
    fresh = [d for d in devices[:n] if d.id not in used]
    used.update(d.id for d in devices[:n])
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in fresh]
    peak = max(peaks) / 2**20 if peaks and None not in peaks else None
    del state, metrics, batch, compiled

    ref = one_device_loss(host_batch)
    ms = statistics.median(times) * 1e3
    tok_s = B * T / (ms / 1e3)
    base = base or tok_s / n
    row = dict(devices=n, mesh=f"{n // (fsdp * seq)}x{fsdp}x{seq}", global_batch=B, step_ms=ms, tokens_per_s=tok_s,
               tokens_per_s_per_device=tok_s / n, efficiency=tok_s / n / base, loss=first_loss,
               loss_rel_diff=abs(first_loss - ref) / abs(ref), peak_mib=peak, compiled_mib=est)
    rows.append(row)
    print(f"| {n} | {row['mesh']} | {B} | {ms:.1f} | {tok_s:,.0f} | {tok_s / n:,.0f} | {row['efficiency']:.2f} "
          f"| {row['loss_rel_diff']:.1e} | {fmt(peak, '.0f')} | {fmt(est, '.1f')} |", flush=True)
  return rows


if __name__ == "__main__":
  main()
