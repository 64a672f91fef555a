"""Argument helpers shared by the benchmark scripts."""

from __future__ import annotations


def apply_preset(args, preset: dict, list_key: str):
  """Fills every argument left at None from `preset`, then parses `list_key` ("1024,2_048,...") into ints."""
  for key, value in preset.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  text = getattr(args, list_key)
  if isinstance(text, str):
    setattr(args, list_key, [int(s.replace("_", "")) for s in text.split(",") if s.strip()])
  return args
