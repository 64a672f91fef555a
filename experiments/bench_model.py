"""Model-level training speed against fla: a full train step (forward, backward, AdamW) of a whole language model.

  # one H200: the 1.3B Gated DeltaNet of configs/lm_paper.py, 8 x 4096 tokens a step, gdn and fla side by side
  python -m experiments.bench_model --config configs/lm_paper.py:gdn-1.3b --batch 8 --seq-len 4096
  # compile time and step time vs depth, scanned against unrolled layers
  python -m experiments.bench_model --config configs/lm_paper.py:gdn-1.3b --batch 8 --seq-len 4096 \
      --depths 4,12,24,48
  # gdn with a module switch set (one row; run it again without to compare)
  python -m experiments.bench_model --config configs/lm_paper.py:gdn-340m --batch 8 --seq-len 4096 --fla off \
      --switch ops.pallas_chunk.BWD_STATES=on
  # CPU, a tiny model (fla needs CUDA and is skipped)
  python -m experiments.bench_model --config configs/lm_paper.py:hybrid-340m --batch 2 --seq-len 64 \
      --override model.d_model=64 --override model.num_layers=4 --override model.recurrent.head_dim=16 \
      --override model.recurrent.v_head_dim=32 --override model.attention.head_dim=16 --override model.dtype=float32

gdn: `gdn.train.step.make_train_step` (the step gdn-train runs: loss, gradients, clipping, AdamW with float32
master weights and `model.dtype` compute), compiled ahead of time: "compile s" is lowering + XLA compilation.
fla: `GatedDeltaNetForCausalLM` (`TransformerForCausalLM` for an attention-only pattern) built from the same
shapes, float32 weights under `torch.autocast(bfloat16)` (the same precision split as gdn's), fused cross
entropy (fla's default), `clip_grad_norm_(1.0)` and `torch.optim.AdamW(fused=True)` in every step; "compile s"
is its first step (Triton's kernel compilation). fla 0.6.0 refuses its gated backward on Hopper with Triton
< 3.7.1 (a numerics guard); for timing only `fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1` is forced to True,
and the header says so. fla runs first and empties PyTorch's cache before gdn starts; JAX does not preallocate
here (XLA_PYTHON_CLIENT_PREALLOCATE=false), so both allocators' peaks are real.

Columns: step ms is the median of --steps steps after --warmup (each waited on); tokens/s = batch x seq len /
step; MFU = FLOP per step / step time / --peak-tflops (default the H200's dense bf16 989 TFLOP/s), with the
FLOP of `gdn.bench.model_flops.train_flops_per_token` (6 N for the matmuls plus the causal attention and chunked
delta-rule mixing, the same count for both); peak GiB is the allocator's peak (PyTorch's
max_memory_allocated, JAX's peak_bytes_in_use; never reset in JAX, so in --depths mode it is the largest so
far); XLA GiB is XLA's estimate for the compiled step (arguments + outputs + temporaries - donated). The
batches are random tokens (the work does not depend on them); every step repeats one batch, and both sides
follow the config's schedule (fla through a LambdaLR on gdn's `lr_shape`), so "loss", the last step's, compares
like with like: about ln(vocab) while the warm-up keeps the rate near zero.

--profile N prints, after the table, each side's N kernels with the most device time per step (gdn's also per
named stage), from a profiler trace of --steps steps: fla's with torch.profiler in this process, gdn's in a child
process (this script again with --fla off and the same config, --sweep-model, overrides, switches, batch, tokens
and steps, told by a hidden --profile-json PATH where to write its profile; `gdn.bench.profile.jax_profile_in_child`).
The child runs before this process's own gdn step, whose memory JAX's allocator would otherwise still hold (the
340M model's two steps do not fit an H100's 80 GB). It keeps jax.profiler clear of the CUPTI subscriber
torch.profiler holds, and on a GPU it runs with XLA's command buffers off (`--xla_gpu_enable_command_buffer=`),
without which the trace names CUDA-graph command buffers instead of the HLO ops that map kernels to stages. gdn's
table says so: its device time per step is of kernels launched one by one and need not match the step ms above.
A failing child leaves its exit code and stderr's end instead. With both sides profiled, a last table sets their
device time side by side per part of the step (the op's state pass, the rest of the op, the short conv, the norms,
everything else; `gdn.bench.profile.parts_table`), every kernel counted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def parse_args(argv=None):
  from experiments.cli import add_autotune_cache

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/lm_paper.py:gdn-340m", help="a config file spec (FILE.py[:ARG])")
  p.add_argument("--sweep-model", metavar="NAME",
                 help="one model of the config's sweep (sweep.models, e.g. kda_15to1 of configs/lm_hybrids.py): "
                      "its overrides first, then --override's")
  p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                 help="any config key, e.g. model.remat=dots (repeatable)")
  p.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                 help="a module switch under gdn for gdn's side, VALUE off, on or auto (an integer "
                      "for an int setting, e.g. a block size), e.g. ops.pallas_chunk.BWD_STATES=on (repeatable)")
  p.add_argument("--batch", type=int, default=8, help="sequences a step")
  p.add_argument("--token-file", metavar="PATH",
                 help="take the batch from this token file (data.text.token_dtype) instead of random tokens")
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first of which compiles")
  p.add_argument("--steps", type=int, default=5, help="timed steps")
  p.add_argument("--fla", choices=("auto", "on", "off"), default="auto",
                 help="run fla too: auto = where it imports and CUDA is present; on = fail without it")
  p.add_argument("--depths", default="", help="comma-separated layer counts: compile and step time per depth")
  p.add_argument("--layouts", default="scan,unrolled", help="with --depths: scan, unrolled or both")
  p.add_argument("--peak-tflops", type=float, default=None, help="the MFU denominator (default: H200 bf16)")
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="after the table, each side's N kernels with the most device time per step (gdn's also per "
                      "named stage: embed, norm, recurrent/..., attention, mlp, head, loss, optimizer), from a "
                      "profiler trace of --steps steps (gdn's in a child process)")
  add_autotune_cache(p)
  p.add_argument("--profile-json", metavar="PATH", help=argparse.SUPPRESS)  # a profiling child's output
  a = p.parse_args(argv)
  if a.batch < 1 or a.seq_len < 2:
    p.error("--batch must be >= 1 and --seq-len >= 2")
  if a.profile and a.depths:
    p.error("--profile is for the one model's table, not --depths")
  a.depths = [int(s) for s in a.depths.split(",") if s.strip()]
  a.layouts = [s.strip() for s in a.layouts.split(",") if s.strip()]
  if set(a.layouts) - {"scan", "unrolled"} or not a.layouts:
    p.error(f"--layouts must name scan and/or unrolled, got {a.layouts}")
  return a


def experiment_config(a, *extra):
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from gdn.train.config_file import resolve, sweep_model_overrides

  spec = a.config if os.path.isabs(a.config.partition(":")[0]) else os.path.join(ROOT, a.config)
  model = sweep_model_overrides(spec, a.sweep_model, a.config)
  return resolve(spec, [*model, f"data.text.seq_len={a.seq_len}", *a.override, *extra])


def tokens(a, vocab: int, dtype: str):
  """The step's batch: uniform random tokens, or with --token-file the file's first batch x (seq_len + 1) tokens
  (`dtype`: the config's data.text.token_dtype): real text, whose bytes repeat far more than random tokens'
  (a fifth of a Python corpus is spaces), for operations whose cost could depend on that (gdn.layers.embed)."""
  import numpy as np

  if not a.token_file:
    return np.random.default_rng(0).integers(0, vocab, size=(a.batch, a.seq_len + 1)).astype(np.int32)
  from gdn.data.text import token_stream

  stream = token_stream(a.token_file, dtype, "train_file", vocab)  # the file a training run would read
  n = a.batch * (a.seq_len + 1)
  if len(stream) < n:
    raise SystemExit(f"--token-file {a.token_file} holds {len(stream)} tokens, fewer than the {n} of one batch "
                     f"({a.batch} x (--seq-len {a.seq_len} + 1))")
  return np.asarray(stream[:n], np.int32).reshape(a.batch, a.seq_len + 1)


def run_gdn(cfg, toks, a) -> dict:
  """Compile and time gdn's train step on the first device."""
  import jax
  import numpy as np

  from gdn.bench.timing import compiled_bytes, device_memory_stats, time_steps
  from gdn.train import optimizer, step

  tx = optimizer.make_optimizer(cfg.train)
  # Eager, as gdn-train initialises: a jitted init is one program over every layer (the layers are built one
  # by one, so that both layouts get the same parameters), and at 48 layers XLA took 2.5 min to compile it.
  graphdef, state = step.init(cfg.model, tx, cfg.seed)
  batch = jax.device_put(dict(inputs=toks[:, :-1], targets=toks[:, 1:],
                              weights=np.ones(toks[:, 1:].shape, np.float32)))
  t0 = time.perf_counter()
  compiled = step.make_train_step(graphdef, tx, optimizer.lr_shape(cfg.train),
                                  loss_chunk=cfg.train.loss_chunk).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  held = dict(state=state)

  def one():
    held["state"], held["metrics"] = compiled(held["state"], batch)

  r = time_steps(one, lambda: jax.block_until_ready(held["state"]), warmup=a.warmup, steps=a.steps)
  r.update(compile_s=compile_s, xla_bytes=compiled_bytes(compiled),
           peak_bytes=device_memory_stats().get("peak_bytes_in_use"),
           loss=float(held["metrics"]["loss"]))
  if a.profile and a.profile_json:  # a profiling child (gdn_profile_in_child)
    from gdn.bench.profile import jax_kernel_times
    r["profile"] = jax_kernel_times(lambda: (one(), jax.block_until_ready(held["state"])), a.steps,
                                    compiled.as_text())
  del held, state, batch, compiled
  gc.collect()
  return r


def child_argv(a) -> list:
  """The profiling child's arguments: gdn alone (--fla off) with every option of `a` that shapes gdn's step (the
  config, --sweep-model, overrides, switches, batch, tokens, steps), so that it traces the model the table timed."""
  argv = ["--fla", "off", "--config", a.config, "--batch", str(a.batch), "--seq-len", str(a.seq_len),
          "--warmup", str(a.warmup), "--steps", str(a.steps), "--profile", str(a.profile)]
  argv += ["--sweep-model", a.sweep_model] if a.sweep_model else []
  argv += [f"--override={o}" for o in a.override] + [f"--switch={w}" for w in a.switch]
  argv += ["--token-file", a.token_file] if a.token_file else []
  return argv


def gdn_profile_in_child(a) -> dict:
  """gdn's profile of one training step (run_gdn's, or {"error": ...}), traced in a child process: this script
  with `child_argv(a)` (gdn.bench.profile.jax_profile_in_child)."""
  from gdn.bench.profile import jax_profile_in_child

  return jax_profile_in_child("experiments.bench_model", child_argv(a))[0]


def fla_model(cfg):
  """fla's CausalLM with `cfg`'s shapes: Gated DeltaNet layers (and global attention where the pattern has
  "A"), or fla's Transformer for an attention-only pattern."""
  from gdn.layers.mlp import hidden_size

  kinds, r, att = cfg.layer_kinds, cfg.recurrent, cfg.attention
  if "sliding_window" in kinds:
    raise ValueError("the fla comparison covers global attention only, got 'W' layers")
  common = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                intermediate_size=hidden_size(cfg.d_model, cfg.mlp_ratio), tie_word_embeddings=cfg.tie_embeddings,
                norm_eps=cfg.norm_eps, max_position_embeddings=1 << 20)
  if set(kinds) == {"attention"}:
    from fla.models import TransformerConfig, TransformerForCausalLM

    return TransformerForCausalLM(TransformerConfig(num_heads=att.num_heads, num_kv_heads=att.KVH,
                                                    rope_theta=att.rope_theta, **common))
  if (r.decay, r.beta, r.qk_norm) != ("head", "head", "l2") or r.output_gate == "sigmoid":
    raise ValueError("the fla comparison covers the gated_deltanet mixer preset only")
  from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

  attn = [i for i, k in enumerate(kinds) if k == "attention"]
  spec = dict(layers=attn, num_heads=att.num_heads, num_kv_heads=att.KVH, window_size=None,
              rope_theta=att.rope_theta) if attn else None
  return GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
      num_heads=r.num_heads, num_v_heads=r.HV, head_dim=r.head_dim, expand_v=r.V / r.head_dim,
      use_gate=r.output_gate != "none", use_short_conv=r.short_conv, conv_size=r.conv_size,
      allow_neg_eigval=r.allow_neg_eigval, attn=spec, **common))


def run_fla(cfg, toks, a) -> dict:
  """Time fla's train step on the current CUDA device; its memory is handed back afterwards."""
  import torch
  import fla.ops.common.chunk_o as chunk_o

  from gdn.bench.timing import time_steps

  patched = not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
  chunk_o.TRITON_ABOVE_3_7_1 = True
  torch.manual_seed(0)
  model = fla_model(cfg.model).cuda()
  t = cfg.train
  opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.b1, t.b2), eps=t.eps,
                          weight_decay=t.weight_decay, fused=True)
  # gdn's schedule (warm-up, cosine) as a factor on fla's rate, so that both sides take the same steps and the
  # loss column compares like with like (both train on the one batch that every step repeats).
  from gdn.train.optimizer import lr_shape
  shape = lr_shape(t)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(shape(step)))
  ids = torch.from_numpy(toks[:, :-1]).long().cuda()
  held = {}

  def one():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = model(input_ids=ids, labels=ids).loss  # the labels are shifted inside
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    held["loss"] = loss

  torch.cuda.reset_peak_memory_stats()
  r = time_steps(one, torch.cuda.synchronize, warmup=a.warmup, steps=a.steps)
  r.update(compile_s=r["first_s"], peak_bytes=torch.cuda.max_memory_allocated(), xla_bytes=None,
           loss=float(held["loss"]), patched=patched, params=sum(p.numel() for p in model.parameters()))
  if a.profile:
    from gdn.bench.profile import torch_kernel_times
    r["profile"] = torch_kernel_times(one, a.steps)
  del model, opt, ids, held
  gc.collect()
  torch.cuda.empty_cache()
  return r


def fla_available(mode: str):
  """(True, "") when fla should run; (False, why) otherwise."""
  if mode == "off":
    return False, "--fla off"
  try:
    import torch
    import fla  # noqa: F401
  except ImportError as e:
    if mode == "on":
      raise
    return False, f"not installed ({e.name})"
  if not torch.cuda.is_available():
    if mode == "on":
      raise SystemExit("--fla on needs a CUDA device")
    return False, "no CUDA device"
  return True, ""


def cells(r, flop_per_step, tokens_per_step, peak_tflops) -> str:
  """The measured columns of one row, from compile s to loss."""
  gib = lambda b: "-" if b is None else f"{b / GiB:.1f}"
  mfu = flop_per_step / (r["step_ms"] / 1e3) / (peak_tflops * 1e12)
  return (f"{r['compile_s']:.1f} | {r['step_ms']:.1f} | {tokens_per_step / (r['step_ms'] / 1e3):,.0f} "
          f"| {100 * mfu:.1f}% | {gib(r['peak_bytes'])} | {gib(r['xla_bytes'])} | {r['loss']:.3f} |")


def main(argv=None) -> list:
  """Prints the table; returns its rows as dicts. The --switch settings hold while gdn's step is traced (fla's
  side has none) and are put back after."""
  a = parse_args(argv)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from experiments.cli import apply_setting
  from gdn.bench import autotune_cache

  autotune_cache.use(None if a.fla == "off" else a.autotune_cache)

  restores = [apply_setting(setting) for setting in a.switch]
  try:
    return measure(a)
  finally:
    for restore in reversed(restores):
      restore()


def measure(a) -> list:
  """`main`'s table for the parsed arguments `a`."""
  import jax

  from gdn.bench.model_flops import H200_BF16_TFLOPS, param_count, train_flops_per_token

  peak_tflops = a.peak_tflops or H200_BF16_TFLOPS
  cfg = experiment_config(a)
  m = cfg.model
  toks = tokens(a, m.vocab_size, cfg.data.text.token_dtype)
  dev = jax.devices()[0]
  n_tok = a.batch * a.seq_len
  n_layers = "each row's" if a.depths else m.num_layers
  model = [f"--sweep-model {a.sweep_model}"] if a.sweep_model else []
  spec = " ".join([a.config, *model, *a.override]) + "".join(f"; gdn switch {w}" for w in a.switch)
  print(f"# {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; {spec}: "
        f"{m.pattern} x {n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.dtype} compute, "
        f"remat {m.remat}, method {m.recurrent.method}; {a.batch} x {a.seq_len} tokens a step; "
        f"{a.warmup} warm-up steps, median of {a.steps}; MFU against {peak_tflops:g} TFLOP/s")
  head = "| compile s | step ms | tokens/s | MFU | peak GiB | XLA GiB | loss |"
  out = []
  if a.depths:
    print(f"| layers | layout | params {head}")
    print("|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for depth in a.depths:
      for layout in a.layouts:
        c = experiment_config(a, f"model.num_layers={depth}", f"model.scan_layers={str(layout == 'scan').lower()}")
        flop = train_flops_per_token(c.model, a.seq_len, chunk_size=c.model.recurrent.chunk_size)
        r = run_gdn(c, toks, a)
        out.append(dict(layers=depth, layout=layout, params=flop["params"], **r))
        print(f"| {depth} | {layout} | {flop['params'] / 1e6:,.1f}M | "
              + cells(r, flop["total"] * n_tok, n_tok, peak_tflops), flush=True)
    return out

  flop = train_flops_per_token(m, a.seq_len, chunk_size=m.recurrent.chunk_size)
  print(f"# {param_count(m):,} parameters; {flop['total'] * n_tok / 1e12:.1f} TFLOP a step "
        f"({flop['matmul'] / flop['total']:.0%} matmul)")
  run, why = fla_available(a.fla)
  print(f"| implementation {head}")
  print("|:---|---:|---:|---:|---:|---:|---:|---:|", flush=True)

  def row(name, r):  # printed as soon as measured: a command cut by a time limit keeps the rows it finished
    print(f"| {name} | " + cells(r, flop["total"] * n_tok, n_tok, peak_tflops), flush=True)
    out.append(dict(name=name, **r))

  if run:
    try:
      r = run_fla(cfg, toks, a)
      row(f"fla {r['params'] / 1e6:,.1f}M" + (" (TRITON_ABOVE_3_7_1 forced)" if r["patched"] else ""), r)
    except Exception as e:  # e.g. fla's attention layers need flash-attn; gdn's row still runs
      if a.fla == "on":
        raise
      run, why = False, f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
  # the profiling child runs before this process's own gdn step: JAX's allocator keeps what a step used, and
  # this process's step beside the child's would need twice the model's memory (the 340M model on an H100)
  child = gdn_profile_in_child(a) if a.profile and not a.profile_json else None
  row(f"gdn {flop['params'] / 1e6:,.1f}M", run_gdn(cfg, toks, a))
  if not run:
    print(f"fla: skipped, {why}")
  if a.profile_json:
    from gdn.bench.profile import write_profiles
    write_profiles(a.profile_json, [r["profile"] for r in out if "profile" in r])
  elif child is not None:
    out[-1]["profile"] = child
  if a.profile:
    from gdn.bench.profile import format_times, parts_table
    profiles = {r["name"].split()[0]: r["profile"] for r in out if "profile" in r}
    for side, prof in profiles.items():
      print("\n" + format_times(prof, a.profile, title=f"{side}, one training step: "))
    if set(profiles) == {"gdn", "fla"}:
      print("\n" + parts_table(profiles["gdn"], profiles["fla"]))
  return out


if __name__ == "__main__":
  main()
