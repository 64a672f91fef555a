"""Where a step's device time goes: per kernel and per named stage, from a profiler trace.

`jax_kernel_times` traces a few calls of a JAX step with `jax.profiler` (its Perfetto trace, written by jax itself,
no plugin needed), sums the time of every XLA operation the device ran (GPU kernels on a GPU; the CPU's thunks on
a CPU), and names each by the JAX operation that made it (the `op_name` in the compiled module), so that the
stages the ops and layers name with `jax.named_scope` (`gated_delta_rule/chunk_local`, `state_pass`, `output`,
`short_conv`, ...) add up. `torch_kernel_times` does the same for a PyTorch step (fla's), per kernel. On a GPU
the kernels are the leaves of the trace; on a CPU a loop's thunk and its body's are both counted, so there the
shares are a hint.

`jax_profile_in_child` runs the JAX side of a benchmark's profile in a child process of its own (the benchmark
script again, gdn alone), for two reasons found on an H200: a process has one CUPTI subscriber, and once
torch.profiler (kineto) has traced fla's step, jax.profiler's trace of the same process comes back empty; and
XLA:GPU runs most of a step inside CUDA-graph command buffers, whose trace events name the command buffer instead of
the HLO op, so that no kernel can be traced back to its stage. The child therefore gets
`--xla_gpu_enable_command_buffer=` (no command buffers) in XLA_FLAGS on a GPU, and the table then says so.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile

from gdn.bench.peak import hlo_bytes, hlo_ops, op_parts


# Name-stack entries that are control flow or JAX's own helpers, not stages.
_NOT_STAGES = {"while", "body", "cond", "closed_call", "remat", "checkpoint", "rematted_computation", "pjit",
               "core_call", "custom_jvp_call", "custom_vjp_call", "shard_map", "vmap", "scan", "branch"}


def stage_of(op_name: str, depth: int = 3) -> str:
  """The first `depth` named scopes of a JAX op name, prefixed by the side: 'bwd: gated_delta_rule/chunk_local'
  for 'jit(f)/transpose(jvp(gated_delta_rule))/chunk_local/dot_general'. Transformation wrappers, control flow
  (while, body, ...), einsum specs and private helpers (`_where`) are left out; '(unnamed)' without an op name."""
  if not op_name:
    return "(unnamed)"
  side, parts = op_parts(op_name)
  scopes = [name for wrapper, name in parts[1:-1]  # the first is the jitted function, the last the primitive
            if wrapper != "jit"  # a jitted library function (jax.nn.silu, ...), not a stage
            and name not in _NOT_STAGES and "->" not in name and "," not in name and not name.startswith("_")]
  return f"{side}: " + ("/".join(scopes[:depth]) if scopes else "(no scope)")


# The XLA flag that turns off XLA:GPU's command buffers (CUDA graphs): an empty list of command types.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def command_buffers_off(xla_flags: str) -> bool:
  """Whether an XLA_FLAGS string turns XLA:GPU's command buffers off (its last --xla_gpu_enable_command_buffer=
  is empty)."""
  values = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith(NO_COMMAND_BUFFERS)]
  return bool(values) and not values[-1].strip("'\"")


def child_env(backend: str, env=None) -> dict:
  """A copy of `env` (default os.environ) for a profiling child: on backend "gpu", XLA_FLAGS gets
  NO_COMMAND_BUFFERS appended (its flags kept), so that the trace names each kernel's HLO op; on any other
  backend (no such GPU flag wanted) it is left as it is."""
  env = dict(os.environ if env is None else env)
  if backend == "gpu":
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
  return env


def write_profiles(path: str, profiles: list) -> None:
  """Writes a list of profile dicts (jax_kernel_times') to `path` as JSON, for the parent of a profiling child."""
  with open(path, "w") as f:
    json.dump(profiles, f)


def read_profiles(path: str) -> list:
  """The list of profile dicts that write_profiles wrote, with the rows of "kernels" and "stages" tuples again."""
  with open(path) as f:
    profiles = json.load(f)
  for prof in profiles:
    for key in ("kernels", "stages"):
      prof[key] = [tuple(row) for row in prof.get(key, [])]
  return profiles


def _tail(text: str, lines: int = 12, chars: int = 3000) -> str:
  return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def jax_profile_in_child(module: str, argv: list, backend: str | None = None) -> list:
  """Runs `python -m module *argv --profile-json PATH` from the repository's root (the benchmark script again,
  told to profile gdn alone and write its profile dicts to PATH with write_profiles) and returns the dicts it
  wrote. backend: the parent's jax.default_backend() (asked of jax when None); on "gpu" the child runs without
  command buffers (child_env). A child that fails gives one dict {"error": its exit code and the end of its
  stderr}, one that exits 0 but writes no profile (the scripts catch a failing shape and print why) one with the
  end of its stdout; format_times prints it in place of a table."""
  if backend is None:
    import jax
    backend = jax.default_backend()
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "profiles.json")
    p = subprocess.run([sys.executable, "-m", module, *argv, "--profile-json", path], cwd=ROOT,
                       env=child_env(backend), capture_output=True, text=True)
    profiles = read_profiles(path) if p.returncode == 0 and os.path.exists(path) else []
  if not profiles:
    why = f"exited with code {p.returncode}" if p.returncode else "exited with code 0 but wrote no profile"
    streams = [("stderr", p.stderr), ("stdout", p.stdout)][::1 if p.returncode else -1]
    stream, text = next(((name, text) for name, text in streams if text.strip()), ("output", ""))
    return [dict(error=f"the profiling child (python -m {module}) {why}"
                 + (f"; the end of its {stream}:\n{_tail(text)}" if text.strip() else ""))]
  return profiles


def _trace_events(log_dir: str) -> list:
  path = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not path:
    raise RuntimeError("jax.profiler wrote no Perfetto trace")
  data = json.load(gzip.open(sorted(path)[-1]))
  return data["traceEvents"] if isinstance(data, dict) else data


def jax_kernel_times(step, steps: int = 5, hlo_text: str | None = None) -> dict:
  """Trace `steps` calls of `step()` (which runs and blocks on one step; call it once before, to compile) and sum
  the device time of each operation. hlo_text: the optimised module's text (`compiled.as_text()`), which names
  each operation's JAX origin. Returns {"steps", "total_us" (per step), "kernels": [(us per step, launches per
  step, kernel, hlo op, stage)], "stages": [(us per step, stage)]}, largest first; with hlo_text also "bytes":
  {hlo op: bytes a launch reads and writes, estimated from the module's shapes (`peak.hlo_bytes`)} for the traced
  kernels' ops, which `format_times` turns into each kernel's bandwidth."""
  import jax

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        step()
    events = _trace_events(tmp)
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
  ops = hlo_ops(hlo_text) if hlo_text else {}
  kernels = collections.defaultdict(lambda: [0.0, 0, "", ""])
  for e in events:
    if e.get("ph") != "X":
      continue
    args = e.get("args", {})
    on_device = e["pid"] in devices if devices else "hlo_op" in args  # a CPU runs its thunks on the host
    if not on_device:
      continue
    hlo_op = args.get("hlo_op", "")
    k = kernels[(e["name"], hlo_op)]
    k[0] += e.get("dur", 0.0)
    k[1] += 1
    k[2] = stage_of(ops.get(hlo_op, ("", ""))[1]) if hlo_op in ops else "(not in the module)"
  rows = sorted(((v[0] / steps, v[1] / steps, name, hlo_op, v[2]) for (name, hlo_op), v in kernels.items()),
                key=lambda r: -r[0])
  stages = collections.defaultdict(float)
  for us, _, _, _, stage in rows:
    stages[stage] += us
  sizes = hlo_bytes(hlo_text) if hlo_text else {}
  traffic = {op: sizes[op] for _, _, _, op, _ in rows if op in sizes}
  return dict(steps=steps, total_us=sum(r[0] for r in rows), kernels=rows, **({"bytes": traffic} if traffic else {}),
              stages=sorted(((us, s) for s, us in stages.items()), reverse=True),
              source=", ".join(sorted(procs[p] for p in devices)) if devices else "host threads (XLA thunks)",
              command_buffers_off=jax.default_backend() == "gpu"
              and command_buffers_off(os.environ.get("XLA_FLAGS", "")))


def torch_kernel_times(step, steps: int = 5) -> dict:
  """The same for a PyTorch `step()` (run once before, for autotuning): device time per kernel (CUDA kernels on a
  GPU, the CPU's operators on a CPU). Returns {"steps", "total_us", "kernels": [(us per step, calls per step,
  kernel, "", "")]}."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  cuda = torch.cuda.is_available()
  with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      step()
    if cuda:
      torch.cuda.synchronize()
  rows = []
  for ev in prof.key_averages():
    us = getattr(ev, "self_device_time_total", None) if cuda else ev.self_cpu_time_total
    if us is None:  # older torch
      us = ev.self_cuda_time_total
    if us > 0:
      rows.append((us / steps, ev.count / steps, ev.key, "", ""))
  rows.sort(key=lambda r: -r[0])
  return dict(steps=steps, total_us=sum(r[0] for r in rows), kernels=rows, stages=[],
              source="CUDA kernels" if cuda else "CPU operators")


# The parts of a Gated DeltaNet model's training step that gdn and fla both have, for `parts_table`: gdn's kernels
# by the stage they ran in (the named scopes of `gdn.layers.recurrent` and the model) and the state pass by its
# Pallas kernels' names, fla's kernels by their names (fla 0.6.0's Triton kernels; cuBLAS GEMMs and PyTorch's
# elementwise and copy kernels fall to the last part). The first part that matches takes a kernel. A fusion of XLA
# counts where its HLO op is named: work fused across stages (the short conv's forward, which XLA fuses into the
# q/k norm's or the projections' kernels) counts in that other stage's part.
PARTS = ("op: state pass", "op: the rest", "short conv", "norms", "everything else")
_GDN_STATE_PASS = re.compile(r"^gdn_chunk_d?states_")
_GDN_STAGES = (("op: the rest", ("gated_delta_rule", "gates")), ("short conv", ("short_conv",)),
               ("norms", ("qk_norm", "out_norm", "norm")))
_FLA_KERNELS = (("op: state pass", re.compile(r"^chunk_gated_delta_rule_(fwd_kernel_h|bwd_kernel_dhu)")),
                ("op: the rest", re.compile(r"^(chunk_|prepare_wy_repr|recompute_w_u|solve_tril|merge_16x16|"
                                            r"gdn_gate|fused_recurrent)")),
                ("short conv", re.compile(r"^causal_conv1d")),
                ("norms", re.compile(r"^(layer_norm|rms_norm|l2norm)")))


def part_of(side: str, kernel: str, stage: str = "") -> str:
  """The part (PARTS) of a kernel of gdn's profile (its name and stage, as jax_kernel_times gives them) or of fla's
  (its name). side: "gdn" or "fla"."""
  if side == "fla":
    return next((part for part, pattern in _FLA_KERNELS if pattern.search(kernel)), PARTS[-1])
  if side != "gdn":
    raise ValueError(f"side must be 'gdn' or 'fla', got {side!r}")
  if _GDN_STATE_PASS.search(kernel):
    return PARTS[0]
  scopes = stage.split(": ", 1)[-1].split("/")
  return next((part for part, names in _GDN_STAGES if any(n in scopes for n in names)), PARTS[-1])


def parts(prof: dict, side: str) -> dict:
  """us a step per part (PARTS, in order) of a profile of jax_kernel_times (side "gdn") or torch_kernel_times
  ("fla"), every kernel counted."""
  out = dict.fromkeys(PARTS, 0.0)
  for us, _, name, _, stage in prof["kernels"]:
    out[part_of(side, name, stage)] += us
  return out


def parts_table(gdn_prof: dict, fla_prof: dict) -> str:
  """Markdown: ms a step per part (PARTS) for gdn and fla side by side, their difference and ratio, and the totals:
  where a model-level gap between the two lies. A profile that failed gives a line saying so."""
  failed = [side for side, prof in (("gdn", gdn_prof), ("fla", fla_prof)) if "error" in prof]
  if failed:
    return f"parts: not compared, {' and '.join(failed)} not profiled"
  g, f = parts(gdn_prof, "gdn"), parts(fla_prof, "fla")
  lines = ["device time per step by part, both sides (ms; gdn by stage and state-pass kernels, fla by kernel name):",
           "| part | gdn | fla | gdn - fla | gdn / fla |", "|---|---:|---:|---:|---:|"]
  for part in PARTS + ("total",):
    a, b = (sum(g.values()), sum(f.values())) if part == "total" else (g[part], f[part])
    ratio = f"{a / b:.2f}x" if b else "-"
    lines.append(f"| {part} | {a / 1e3:.3f} | {b / 1e3:.3f} | {(a - b) / 1e3:+.3f} | {ratio} |")
  return "\n".join(lines)


def format_times(prof: dict, top: int = 20, title: str = "", per: str = "step") -> str:
  """Markdown tables: the stages (where named), then the `top` kernels, time per step and share. A profile that
  failed ({"error": ...}, from jax_profile_in_child) is a line saying why, then the end of the child's output.
  per: what one unit of the profile's times is ("step"; bench_decode's "token" for a profile scaled to one)."""
  if "error" in prof:
    return f"{title}not profiled: {prof['error']}"
  total = prof["total_us"] or 1.0
  source = f"; {prof['source']}" if prof.get("source") else ""
  if prof.get("command_buffers_off"):
    source += "; traced with XLA's command buffers off, so kernel by kernel, without the CUDA graphs of a timed step"
  mean = f"mean of {prof['steps']} steps" if per == "step" else prof.get("traced", f"per {per}")
  lines = [f"{title}device time per {per}: {prof['total_us'] / 1e3:.3f} ms ({mean}{source})"]
  if prof["stages"]:
    lines += ["| stage | ms | share |", "|---|---:|---:|"]
    lines += [f"| {s} | {us / 1e3:.3f} | {us / total:.1%} |" for us, s in prof["stages"]]
    lines.append("")
  sizes = prof.get("bytes") or {}
  if sizes:  # each kernel's traffic as its HLO shapes give it, and the bandwidth that makes at its measured time
    lines += ["MB a launch: the kernel's operands read once and its result written once, from the module's shapes "
              "(an estimate); GB/s: that traffic over its time", ""]
  extra = " MB a launch | GB/s |" if sizes else ""
  lines += [f"| kernel | launches | ms | share |{extra} stage |",
            "|---|---:|---:|---:|" + ("---:|---:|" if sizes else "") + "---|"]
  for us, n, name, hlo_op, stage in prof["kernels"][:top]:
    label = name if not hlo_op or hlo_op == name else f"{name} ({hlo_op})"
    cells = ""
    if sizes:
      b = sizes.get(hlo_op)
      cells = " - | - |" if b is None else f" {b / 1e6:.1f} | {b * n / us / 1e3 if us else 0:.0f} |"
    lines.append(f"| {label[:90]} | {n:g} | {us / 1e3:.3f} | {us / total:.1%} |{cells} {stage} |")
  return "\n".join(lines)
