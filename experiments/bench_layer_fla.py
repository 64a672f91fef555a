"""One Gated DeltaNet layer's training step: gdn's `RecurrentMixer` against fla's `GatedDeltaNet` layer.

The same layer on both sides: d_model, heads x head_dim, expand_v 1, the SiLU output gate with its RMSNorm,
short convs of 4; float32 parameters and bfloat16 activations (fla under `torch.autocast`). Measured: the
gradient of the sum of the layer's output with respect to its parameters and its input, median ms of --reps
steps after warm-up, and the allocator's peak bytes (JAX `peak_bytes_in_use`, PyTorch `max_memory_allocated`),
parameters, input and gradients included. Each (side, T) runs in a process of its own: an allocator's peak is
the process's. Rows keep the tokens per batch fixed (B = tokens // T).

  python -m experiments.bench_layer_fla                                   # the H200 shapes, gdn method auto
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --remats none,op,layer   # a row each
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --local-groups 1,4,8      # a row each
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --peak 25   # what each side keeps
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --switch layers.conv.CONV_VJP=off,on
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --peak 25 \
      --switch ops.intra_chunk.LOWP_SOLVE=off,on --switch ops.intra_chunk.LOCAL_VJP=off,on   # four gdn rows
  python -m experiments.bench_layer_fla --lengths 8192 --method pallas --sides gdn --peak 24 \
      --xla-flags= --xla-flags=--xla_gpu_enable_latency_hiding_scheduler=true   # a row per set of XLA flags
  python -m experiments.bench_layer_fla --preset cpu --sides gdn          # a CPU smoke run (fla needs CUDA)

fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (a numerics guard); for timing only the
fla side sets `fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.cli import add_autotune_cache, apply_preset, apply_setting, setting_label, switch_settings
from gdn.bench import autotune_cache

PRESETS = {
    "h200": dict(d_model=2048, heads=16, head_dim=128, tokens=65536, lengths="2048,8192,32768", reps=10),
    "cpu": dict(d_model=64, heads=2, head_dim=16, tokens=256, lengths="128", reps=2),
}


def gdn_side(a, T: int, remat: str = "none", local_groups: int = 1) -> dict:
  import jax
  import jax.numpy as jnp

  from experiments.layer_residuals import layer_step
  from gdn.bench.timing import compiled_bytes, device_memory_stats, timed

  loss, params = layer_step(a.d_model, a.heads, a.head_dim, a.method, remat, jnp.bfloat16, local_groups)
  x = jax.random.normal(jax.random.key(1), (a.tokens // T, T, a.d_model), jnp.bfloat16)
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x)
  compiled = lowered.compile()
  ms = timed(compiled, (params, x), a.reps)
  peak = device_memory_stats().get("peak_bytes_in_use")
  out = dict(ms=ms, peak=peak, estimate=compiled_bytes(compiled))
  if a.peak:
    from gdn.bench.peak import allocation_line, grouped, live_at_peak
    live = live_at_peak(lowered)
    out["live"] = dict(total=live["total"], rows=grouped(live["buffers"], a.peak), allocation=allocation_line(live),
                       slices=live["slices"][:a.peak])
  return out


def fla_side(a, T: int, remat: str = "none", local_groups: int = 1) -> dict:
  del remat, local_groups  # gdn's switches
  import torch
  import fla.ops.common.chunk_o as chunk_o
  from fla.layers import GatedDeltaNet

  from gdn.bench.timing import time_steps

  chunk_o.TRITON_ABOVE_3_7_1 = True
  layer = GatedDeltaNet(hidden_size=a.d_model, expand_v=1, head_dim=a.head_dim, num_heads=a.heads, mode="chunk",
                        use_gate=True, use_short_conv=True, conv_size=4).cuda()
  x = torch.randn(a.tokens // T, T, a.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

  def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      y = layer(x)[0]
    y.float().sum().backward()

  r = time_steps(step, torch.cuda.synchronize, warmup=3, steps=a.reps)
  out = dict(ms=r["step_ms"], peak=torch.cuda.max_memory_allocated())
  if a.peak:
    def forward():
      with torch.autocast("cuda", dtype=torch.bfloat16):
        return layer(x)[0]
    out["live"] = saved_by_autograd(forward, a.peak)
  return out


def saved_by_autograd(forward, top: int) -> dict:
  """What PyTorch's autograd keeps for the backward of `forward()` (fla's layer: the counterpart of what is live
  at the start of gdn's backward): the tensors its saved-tensor hooks see, each view of a storage counted once,
  grouped by shape and dtype: {"total": bytes, "rows": [(bytes, count, shape, note)]}."""
  import collections
  import torch

  seen, acc = set(), collections.defaultdict(lambda: [0, 0])

  def pack(t):
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
    if key not in seen:
      seen.add(key)
      group = acc[(str(t.dtype).replace("torch.", ""), tuple(t.shape))]
      group[0] += t.numel() * t.element_size()
      group[1] += 1
    return t

  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    forward()
  rows = sorted(((b, n, f"{dt}{list(shape)}", "saved by autograd") for (dt, shape), (b, n) in acc.items()),
                key=lambda r: -r[0])
  return dict(total=sum(r[0] for r in rows), rows=rows[:top])


SIDES = {"gdn": gdn_side, "fla": fla_side}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
  for name in ("d-model", "heads", "head-dim", "tokens", "reps"):
    p.add_argument(f"--{name}", type=int, help="override the preset")
  p.add_argument("--lengths", help="comma-separated sequence lengths T (override the preset)")
  p.add_argument("--method", default="auto", help="gdn's op method")
  p.add_argument("--remats", default="none", help="comma-separated RecurrentConfig.remat values for gdn (one row each)")
  p.add_argument("--local-groups", default="1",
                 help="comma-separated RecurrentConfig.local_groups values for gdn (one row each per remat)")
  p.add_argument("--sides", nargs="*", default=["gdn", "fla"], choices=sorted(SIDES))
  p.add_argument("--peak", type=int, default=0, metavar="N",
                 help="also list the N largest groups of buffers live at gdn's memory peak (XLA's buffer assignment, "
                      "gdn.bench.peak), XLA's allocation beside that live set with its N largest slices, and the "
                      "tensors fla's autograd keeps for the backward")
  p.add_argument("--switch", action="append", metavar="MODULE.NAME=off,on",
                 help="a module switch under gdn (e.g. layers.conv.CONV_VJP=off,on): one gdn row per setting; "
                      "repeated, one row per combination")
  p.add_argument("--xla-flags", action="append", metavar="FLAGS",
                 help="XLA flags for gdn's process (e.g. '--xla_gpu_enable_latency_hiding_scheduler=true'; '' for "
                      "none): one gdn row per --xla-flags given, beside each remat, group count and switch setting")
  add_autotune_cache(p)
  p.add_argument("--worker", nargs=5, metavar=("SIDE", "T", "REMAT", "GROUPS", "SETTING"), help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  return apply_preset(a, PRESETS[a.preset], "lengths")


def measure(side: str, T: int, remat: str, argv, local_groups: int = 1, setting: str = "-",
            xla_flags: str = "") -> dict:
  """One (side, T, gdn remat, gdn local_groups, gdn switch setting, gdn XLA flags) in a fresh process; its result,
  or the last line of its error. The flags go to the process's XLA_FLAGS, after any it inherits."""
  cmd = [sys.executable, "-m", "experiments.bench_layer_fla", *argv, "--worker", side, str(T), remat,
         str(local_groups), setting]
  env = dict(os.environ)
  if xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  p = subprocess.run(cmd, capture_output=True, text=True, env=env)
  lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
  if lines:
    return json.loads(lines[-1][len("RESULT "):])
  return dict(error=((p.stderr.strip().splitlines() or ["no output"])[-1])[:120])


def _cuda() -> bool:
  try:
    import torch
  except ImportError:
    return False
  return torch.cuda.is_available()


def main(argv=None) -> list:
  argv = list(sys.argv[1:] if argv is None else argv)
  a = parse_args(argv)
  if a.worker:
    side, T, remat, groups, setting = a.worker
    autotune_cache.use(a.autotune_cache if side == "fla" else None)  # each fla worker keeps its choices at exit
    apply_setting(setting)
    print("RESULT " + json.dumps(SIDES[side](a, int(T), remat, int(groups))), flush=True)
    return []
  if "fla" in a.sides and not _cuda():
    raise SystemExit("--sides fla needs CUDA for fla's layer (torch finds no GPU here): "
                     "`--preset cpu --sides gdn` runs gdn's side alone")
  settings = switch_settings(a.switch)
  apply_setting(settings[0])  # fails here, before any worker, if the switch does not exist
  gib = lambda r: f"{r['peak'] / 2**30:.2f}" if r.get("peak") else "-"
  ms = lambda r: f"{r['ms']:.2f}" if "ms" in r else r.get("error", "-")
  print(f"# one Gated DeltaNet layer, fwd+bwd: d_model {a.d_model}, {a.heads} heads x {a.head_dim}, {a.tokens} "
        f"tokens a batch, bfloat16 activations, float32 parameters; gdn method {a.method}; median of {a.reps}")
  flag_sets = a.xla_flags or [""]
  switch = (" | gdn switch" if a.switch else "") + (" | gdn XLA flags" if a.xla_flags else "")
  print(f"| T | B | gdn remat | gdn local_groups{switch} | gdn ms | fla ms | gdn / fla | gdn peak GiB | fla peak GiB | "
        "gdn XLA estimate GiB |")
  print("|---:|---:|---|---:|" + ("---|" if a.switch else "") + ("---|" if a.xla_flags else "") +
        "---:|---:|---:|---:|---:|---:|")
  rows = []
  for T in a.lengths:
    f = measure("fla", T, "none", argv) if "fla" in a.sides else {}
    for remat, groups, setting, flags in ((r, int(G), S, F) for r in a.remats.split(",")
                                          for G in a.local_groups.split(",") for S in settings for F in flag_sets):
      g = measure("gdn", T, remat, argv, groups, setting, flags) if "gdn" in a.sides else {}
      ratio = f"{g['ms'] / f['ms']:.2f}x" if "ms" in g and "ms" in f else "-"
      est = f"{g['estimate'] / 2**30:.2f}" if g.get("estimate") else "-"
      cell = (f" | {setting_label(setting)}" if a.switch else "") + (f" | {flags or '-'}" if a.xla_flags else "")
      print(f"| {T} | {a.tokens // T} | {remat} | {groups}{cell} | {ms(g)} | {ms(f)} | {ratio} | {gib(g)} | {gib(f)} | "
            f"{est} |", flush=True)
      rows.append(dict(T=T, remat=remat, local_groups=groups, setting=setting, xla_flags=flags,
                       **{f"{s}_{k}": v for s, r in (("gdn", g), ("fla", f)) for k, v in r.items()}))
  tables, fla_shown = [], set()  # fla's table once per length (one fla process per T), gdn's per row
  for r in rows:
    if r.get("fla_live") and r["T"] not in fla_shown:
      fla_shown.add(r["T"])
      tables.append((f"kept by fla's autograd for the backward, T {r['T']}", r["fla_live"]))
    if r.get("gdn_live"):
      switch = (f", {r['setting']}" if r["setting"] != "-" else "") + (f", {r['xla_flags']}" if r["xla_flags"] else "")
      tables.append((f"live at gdn's peak (XLA's buffer assignment), T {r['T']}, remat {r['remat']}, "
                     f"local_groups {r['local_groups']}{switch}", r["gdn_live"]))
  for what, live in tables:
    print(f"\n{what}: {live['total'] / 2**20:,.1f} MiB\n| MiB | buffers | shape | made by |\n|---:|---:|---|---|")
    for nbytes, count, shape, op in live["rows"]:
      print(f"| {nbytes / 2**20:,.1f} | {count} | {shape} | {op} |")
    if live.get("allocation"):  # gdn's: the allocator's peak beside the live set, and the block's largest slices
      print(f"\n{live['allocation']}; the largest slices of XLA's memory-usage report (the values that share each):"
            "\n| MiB | offset MiB | values | shapes |\n|---:|---:|---:|---|")
      for r in live["slices"]:
        print(f"| {r['bytes'] / 2**20:,.1f} | {r['offset'] / 2**20:,.1f} | {r['values']} | {r['shapes']} |")
  return rows


if __name__ == "__main__":
  main()
