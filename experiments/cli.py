"""Argument helpers shared by the benchmark scripts."""

from __future__ import annotations

import importlib
import itertools

# The values of a module switch on the command line.
SETTINGS = {"off": False, "on": True, "auto": None, "primal": "primal", "vjp": "vjp"}
# Values that only the named switches take: "primal" and "vjp" are `ops.intra_chunk.SEGSUM_MATMUL`'s (the span sums
# as matmuls where the op is not differentiated, cumulative sums where it is; "vjp": their VJP the matmuls').
ONLY_FOR = {"primal": ("SEGSUM_MATMUL",), "vjp": ("SEGSUM_MATMUL",)}


def takes(name: str, value: str, current=None) -> bool:
  """Whether the module switch `name`, now `current`, takes the command-line value `value`: a key of SETTINGS, or
  a non-negative integer where the setting is an int (a block size, warps: tuning sweeps)."""
  if isinstance(current, int) and not isinstance(current, bool):
    return value.isdigit()
  return value in SETTINGS and name in ONLY_FOR.get(value, (name,))


def _value(value: str):
  return int(value) if value.isdigit() else SETTINGS[value]


def add_autotune_cache(parser):
  """--autotune-cache DIR: fla's Triton autotuning choices read from DIR before fla is imported and the new ones
  written back at exit (`gdn.bench.autotune_cache`)."""
  parser.add_argument("--autotune-cache", metavar="DIR",
                      help="keep fla's Triton autotuning choices in DIR between calls (read before fla is imported, "
                           "the new ones written back at exit; gdn.bench.autotune_cache)")


def apply_preset(args, preset: dict, list_key: str):
  """Fills every argument left at None from `preset`, then parses `list_key` ("1024,2_048,...") into ints."""
  for key, value in preset.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  text = getattr(args, list_key)
  if isinstance(text, str):
    setattr(args, list_key, [int(s.replace("_", "")) for s in text.split(",") if s.strip()])
  return args


def switch_settings(specs):
  """The settings `apply_setting` takes for --switch `MODULE.NAME=a,b` (a spec, or a list of them for a repeated
  --switch: every combination of their values, joined by '+'); ['-'] for none."""
  if not specs:
    return ["-"]
  specs = [specs] if isinstance(specs, str) else specs
  per_switch = []
  for spec in specs:
    path, values = spec.split("=")
    per_switch.append([f"{path}={v}" for v in values.split(",")])
  return ["+".join(combo) for combo in itertools.product(*per_switch)]


def setting_label(setting: str) -> str:
  """A setting's short form for tables: 'LOWP_SOLVE=on+LOCAL_VJP=on' for the module paths of both."""
  return "+".join(part.split(".")[-1] for part in setting.split("+"))


def apply_setting(setting: str):
  """Set the module switches of `setting`, 'MODULE.NAME=VALUE' joined by '+' (MODULE under gdn, e.g.
  layers.conv.CONV_VJP=on; VALUE a key of SETTINGS) in this process; '-' sets nothing. Returns a function that puts
  the previous values back."""
  if setting == "-":
    return lambda: None
  previous = []  # (module, name, value before), in the order set

  def restore():
    for mod, name, before in reversed(previous):
      setattr(mod, name, before)

  for part in setting.split("+"):
    path, value = part.split("=")
    module, name = path.rsplit(".", 1)
    mod = importlib.import_module(f"gdn.{module}")
    current = getattr(mod, name, None)
    if not hasattr(mod, name) or not takes(name, value, current):
      restore()
      taken = [v for v in SETTINGS if takes(name, v, current)] + (["an integer"] if takes(name, "0", current) else [])
      raise SystemExit(f"--switch: gdn.{module} has no setting {name!r}, or {value!r} is not one it takes "
                       f"({', '.join(taken)})")
    previous.append((mod, name, current))
    setattr(mod, name, _value(value))
  return restore
