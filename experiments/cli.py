"""Argument helpers shared by the benchmark scripts."""

from __future__ import annotations

import importlib

SETTINGS = {"off": False, "on": True, "auto": None}


def apply_preset(args, preset: dict, list_key: str):
  """Fills every argument left at None from `preset`, then parses `list_key` ("1024,2_048,...") into ints."""
  for key, value in preset.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  text = getattr(args, list_key)
  if isinstance(text, str):
    setattr(args, list_key, [int(s.replace("_", "")) for s in text.split(",") if s.strip()])
  return args


def switch_settings(spec):
  """The settings `apply_setting` takes for a --switch `MODULE.NAME=a,b` (['-'] for none): [MODULE.NAME=a, ...]."""
  if not spec:
    return ["-"]
  path, values = spec.split("=")
  return [f"{path}={v}" for v in values.split(",")]


def apply_setting(setting: str):
  """Set the module switch `MODULE.NAME=VALUE` (MODULE under gdn, e.g. layers.conv.CONV_VJP=on; VALUE off, on,
  auto) in this process; '-' sets nothing. Returns a function that puts the previous value back."""
  if setting == "-":
    return lambda: None
  path, value = setting.split("=")
  module, name = path.rsplit(".", 1)
  mod = importlib.import_module(f"gdn.{module}")
  if not hasattr(mod, name) or value not in SETTINGS:
    raise SystemExit(f"--switch: gdn.{module} has no setting {name!r}, or {value!r} is not one of off, on, auto")
  before = getattr(mod, name)
  setattr(mod, name, SETTINGS[value])
  return lambda: setattr(mod, name, before)
