"""What is live at a compiled program's memory peak, read from XLA's own buffer assignment.

XLA plans every buffer of a compiled program ahead of time; its dump of that plan (`xla_dump_to`) names the
instructions whose buffers are live at the peak. `live_at_peak` compiles a lowered program once more with the dump
switched on (for this compilation only, through its compiler options), reads the dump and returns those buffers
with their shape and the JAX operation that made them (the `op_name` of the instruction, e.g.
`jit(loss)/transpose(jvp(RecurrentMixer))/dot_general`), largest first. It works on every backend that dumps a
live range (CPU and GPU). The live ranges are XLA's logical ones: an in-place result (an output written over its
operand's memory) counts beside that operand, so the sum can exceed `timing.compiled_bytes`' total somewhat; it
says which buffers make the peak, the allocator's own figure says how high it is.

The allocator's figure can exceed the live set by far: XLA packs every temporary buffer into one preallocated
block at offsets fixed ahead of time, and a slice that holds a large buffer at one time and smaller ones at
others sits partly unused. `live_at_peak` therefore also returns XLA's memory analysis (arguments, outputs,
temporaries) and the block's slices from XLA's memory-usage report (size, offset, the values sharing it).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import math
import os
import re
import tempfile

_LIVE_LINE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?: (\d+) bytes")
_VALUE_LINE = re.compile(r"value: <\d+ (\S+) @(\S+)> \(size=(\d+),offset=\d+\): (\S+)")
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")
# A slice of the memory-usage report: "cumulative(share); size; offset; values sharing it; their shapes".
_SLICE_LINE = re.compile(r"^\s*[\d.]+(?:[KMGT]i)?B\(\s*\d+%\);\s*([\d.]+)([KMGT]i)?B;\s*(\d+);\s*(\d+);\s*(.*)$")
_UNITS = {None: 1, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}


def _one(pattern: str) -> str:
  files = sorted(glob.glob(pattern))
  if not files:
    raise RuntimeError(f"XLA wrote no file matching {os.path.basename(pattern)}: this backend dumps no live range")
  return max(files, key=os.path.getsize)  # the program itself, not a helper module compiled alongside it


def _parse_peak(text: str) -> list[tuple[str, str, int]]:
  """[(instruction, tuple index, bytes)] of the 'Live ranges at N (peak)' section."""
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if re.match(r"\s*Live ranges at \d+ \(peak\):", line):
      rows = []
      for row in lines[i + 1:]:
        r = _LIVE_LINE.match(row)
        if not r:
          break
        rows.append((r.group(1), (r.group(2) or "{}").strip("{}"), int(r.group(3))))
      return rows
  raise RuntimeError("the live-range dump has no peak section")


def hlo_ops(hlo: str) -> dict:
  """instruction name -> (shape text, op_name) of the optimised module. A fusion (or any caller) without an
  op_name of its own takes its called computation's: the root's, else the first one inside."""
  own, calls, comp_names, current = {}, {}, {}, None
  for line in hlo.splitlines():
    head = re.match(r"^\s*(?:ENTRY )?%(\S+) .*\{\s*$", line)
    if head and " = " not in line:
      current = head.group(1)
      continue
    m = re.match(r"^\s*(ROOT )?%(\S+) = (\([^=]*?\)|\S+) ", line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    op = op.group(1) if op else ""
    own[m.group(2)] = (m.group(3), op)
    called = re.search(r"calls=%([\w.\-]+)", line)
    if called:
      calls[m.group(2)] = called.group(1)
    if current and op:
      names = comp_names.setdefault(current, [])
      names.insert(0, op) if m.group(1) else names.append(op)
  out = {}
  for name, (shape, op) in own.items():
    if not op and name in calls:
      op = next(iter(comp_names.get(calls[name], [])), "")
    out[name] = (shape, op)
  return out


_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape's text (an array, or a tuple of them: every element counted; tokens and unknown types
  count nothing; float8 types one byte)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _closing(text: str, start: int) -> int:
  """The index just past the parenthesis that closes the one at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def hlo_bytes(hlo: str) -> dict:
  """instruction name -> bytes it reads and writes, as the optimised module's shapes give them: its result plus each
  operand's whole result. For a kernel (a fusion, a custom call) this is the traffic of reading every operand once
  and writing the result once: an estimate, high where a kernel reads only part of an operand (a dynamic slice) or
  writes in place over one, low where it reads an operand more than once. Names are unique in a module."""
  result, operands = {}, {}
  for line in hlo.splitlines():
    m = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
    if not m:
      continue
    rest = line[m.end():]
    end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end < 0:
      continue
    result[m.group(1)] = shape_bytes(rest[:end])
    call = re.match(r"\s*[\w\-]+\(", rest[end:])
    if call:
      start = end + call.end() - 1
      operands[m.group(1)] = re.findall(r"%([\w.\-]+)", rest[start:_closing(rest, start)])
  return {name: out + sum(result.get(o, 0) for o in operands.get(name, ())) for name, out in result.items()}


def _value_shapes(assignment: str) -> dict:
  """(instruction, tuple index) -> shape text, from the buffer assignment's value list."""
  out = {}
  for m in _VALUE_LINE.finditer(assignment):
    index = m.group(2).strip("{}")
    out[(m.group(1), "" if index == "0" and "{" not in m.group(2) else index)] = m.group(4)
  return out


def slices(report: str) -> list:
  """The slices of an XLA memory-usage report, largest first: [{"bytes", "offset", "values", "shapes"}]."""
  out = []
  for line in report.splitlines():
    m = _SLICE_LINE.match(line)
    if m:
      out.append(dict(bytes=round(float(m.group(1)) * _UNITS[m.group(2)]), offset=int(m.group(3)),
                      values=int(m.group(4)), shapes=m.group(5).strip()))
  return sorted(out, key=lambda r: -r["bytes"])


@contextlib.contextmanager
def _compiled_afresh():
  """jax's persistent compilation cache off for the compilations inside: XLA writes its dumps only when it
  compiles, and the dump options are not part of the cache's key, so a program served from the cache (a run's
  `compilation_cache`, JAX_COMPILATION_CACHE_DIR) would leave no dump. The cache is set up again afterwards."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  before = jax.config.values["jax_enable_compilation_cache"]
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def live_at_peak(lowered, dump_dir: str | None = None) -> dict:
  """Compile `lowered` (a `jax.stages.Lowered`) with XLA's dump on (never served from jax's persistent
  compilation cache) and return what is live at its peak:
  {"total": bytes at the peak, "buffers": [{"name", "bytes", "shape", "op_name"}], largest first,
  "arguments", "outputs", "temp": XLA's memory analysis in bytes, "slices": the preallocated block's slices
  (`slices`; empty where XLA writes no memory-usage report)}."""
  with tempfile.TemporaryDirectory() as tmp:
    where = dump_dir or tmp
    with _compiled_afresh():
      compiled = lowered.compile({"xla_dump_to": where})
    live = open(_one(os.path.join(where, "*after_optimizations-live-range.txt"))).read()
    hlo = open(_one(os.path.join(where, "*after_optimizations.txt"))).read()
    assignment = open(_one(os.path.join(where, "*after_optimizations-buffer-assignment.txt"))).read()
    reports = glob.glob(os.path.join(where, "*after_optimizations-memory-usage-report.txt"))
    report = open(max(reports, key=os.path.getsize)).read() if reports else ""
  m = compiled.memory_analysis()
  rows = _parse_peak(live)
  instrs, shapes = hlo_ops(hlo), _value_shapes(assignment)
  buffers = []
  for name, index, nbytes in rows:
    shape, op_name = instrs.get(name, ("?", ""))
    shape = shapes.get((name, index)) or shapes.get((name, "")) or shape
    buffers.append(dict(name=name + (f"{{{index}}}" if index else ""), bytes=nbytes,
                        shape=re.sub(r"\{[0-9,]*\}$", "", shape), op_name=op_name))
  buffers.sort(key=lambda b: -b["bytes"])
  return dict(total=sum(b["bytes"] for b in buffers), buffers=buffers, arguments=m.argument_size_in_bytes,
              outputs=m.output_size_in_bytes, temp=m.temp_size_in_bytes, slices=slices(report))


def allocation_line(peak: dict) -> str:
  """XLA's allocation beside the live set, in GiB: what the allocator's peak is made of, and how much of it
  no buffer uses at the live set's peak."""
  G = 2 ** 30
  total = peak["arguments"] + peak["outputs"] + peak["temp"]
  unused = max(total - peak["total"], 0)
  return (f"XLA's allocation {total / G:.2f} GiB (arguments {peak['arguments'] / G:.2f}, outputs "
          f"{peak['outputs'] / G:.2f}, temporaries {peak['temp'] / G:.2f}); live at the heap's peak "
          f"{peak['total'] / G:.2f} GiB, so {unused / G:.2f} GiB ({unused / max(total, 1):.0%}) of the allocation "
          "holds no live buffer there")


def op_parts(op_name: str) -> tuple[str, list[tuple[str, str]]]:
  """A JAX op name taken apart: ('bwd' where the operation belongs to the backward (a transpose), else 'fwd';
  [(innermost transformation wrapper or '', name)] per part of its name stack, e.g. ('jvp', 'short_conv'))."""
  side = "bwd" if "transpose(" in op_name else "fwd"
  parts = []
  for part in op_name.split(";")[0].split("/"):
    *wrappers, name = re.sub(r"\)+$", "", part).split("(")
    if name:
      parts.append((wrappers[-1] if wrappers else "", name))
  return side, parts


def short_op(op_name: str, keep: int = 3) -> str:
  """The last `keep` parts of a JAX op name, prefixed by its side (`op_parts`)."""
  side, parts = op_parts(op_name)
  return f"{side}: " + "/".join(name for _, name in parts[-keep:])


def grouped(buffers: list, top: int | None = None) -> list:
  """Buffers summed by (shape, short op name): [(bytes, count, shape, op)], largest first."""
  acc = collections.defaultdict(lambda: [0, 0])
  for b in buffers:
    key = (b["shape"], short_op(b["op_name"]))
    acc[key][0] += b["bytes"]
    acc[key][1] += 1
  rows = sorted(((v[0], v[1], k[0], k[1]) for k, v in acc.items()), key=lambda r: -r[0])
  return rows[:top] if top else rows


def format_peak(peak: dict, per: float = 1.0, unit: str = "bytes", top: int = 20) -> str:
  """A table of `grouped(peak["buffers"])`, bytes divided by `per` (e.g. tokens, or 2**30 with unit 'GiB')."""
  lines = [f"live at the peak: {peak['total'] / per:,.2f} {unit} in {len(peak['buffers'])} buffers",
           f"| {unit} | buffers | shape | made by |", "|---:|---:|---|---|"]
  for nbytes, count, shape, op in grouped(peak["buffers"], top):
    lines.append(f"| {nbytes / per:,.2f} | {count} | {shape} | {op} |")
  return "\n".join(lines)
