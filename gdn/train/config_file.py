"""Config files (ml_collections `get_config()`) and strict `key=value` overrides.

Every key must already exist in the loaded config (the base declares them all), so a typo or an undeclared
key fails with its full name instead of being silently ignored; values are parsed by the type of the value
they replace.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import os
import sys

import ml_collections

from gdn.train.config import ConfigError, ExperimentConfig, from_dict


def base_config() -> ml_collections.ConfigDict:
  """Every key of ExperimentConfig, at its default: the base that config files change."""
  return ml_collections.ConfigDict(dataclasses.asdict(ExperimentConfig()))


def load(spec: str) -> ml_collections.ConfigDict:
  """Runs `get_config()` of a config file; "path.py:arg" passes arg (e.g. "configs/mqar.py:small")."""
  path, _, arg = spec.partition(":")
  if path.endswith(".json"):  # a run's resolved config, to repeat a run exactly
    try:
      with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))
    except OSError as e:
      raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
      raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  path = os.path.abspath(path)
  # Config files import their base as `configs.base`: make the directory above configs/ importable.
  for p in (os.path.dirname(os.path.dirname(path)), os.path.dirname(path)):
    if p not in sys.path:
      sys.path.insert(0, p)
  name = "gdn_config_" + os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path!r} has no get_config()")
  takes = [p for p in inspect.signature(module.get_config).parameters.values()
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  if arg and not takes:
    raise ConfigError(f"config file {path!r} takes no argument (its get_config() has none), got {spec!r}")
  return module.get_config(arg) if arg else module.get_config()


def parse_value(key: str, current, text: str):
  """`text` as the type of `current` (the value the override replaces)."""
  def bad(kind):
    return ConfigError(f"config.{key} expects {kind}, got {text!r}")
  if isinstance(current, bool):
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
      return True
    if low in ("false", "0", "no"):
      return False
    raise bad("a bool (true/false)")
  if isinstance(current, int):
    try:
      return int(text)
    except ValueError:
      raise bad("an int") from None
  if isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      raise bad("a float") from None
  if isinstance(current, str):
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
      return text[1:-1]
    return text
  if isinstance(current, (tuple, list)) or current is None:
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      if current is None:
        return text
      raise bad("a tuple such as (1, 2)") from None
    if current is not None and not isinstance(value, (tuple, list)):
      raise bad("a tuple such as (1, 2)")
    return tuple(value) if isinstance(value, list) else value
  raise bad(type(current).__name__)


def override(config: ml_collections.ConfigDict, key: str, text: str) -> None:
  """config.<key> = text, parsed; `key` is dotted ("model.recurrent.decay")."""
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts):
    here = ".".join(parts[:i + 1])
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(f"unknown config key config.{key}: config.{'.'.join(parts[:i])} is not a section")
    if part not in node:
      close = difflib.get_close_matches(part, list(node.keys()), n=1)
      hint = f" (did you mean config.{'.'.join(parts[:i] + close)}?)" if close else ""
      raise ConfigError(f"unknown config key config.{here}{hint}")
    if i < len(parts) - 1:
      node = node[part]
  current = node[parts[-1]]
  if isinstance(current, ml_collections.ConfigDict):
    raise ConfigError(f"config.{key} is a section; set one of its keys ({', '.join(sorted(current.keys()))})")
  value = parse_value(key, current, text)
  with node.ignore_type():
    node[parts[-1]] = value


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """Applies "key=value" strings in order (a later one wins)."""
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ConfigError(f"override {item!r} must look like key=value")
    override(config, key.strip().removeprefix("config."), text)
  return config


def sweep_model_overrides(spec: str, name, label: str = "") -> list:
  """The overrides of model `name` of the config file's sweep.models ([] for no name), for scripts that build one
  model of a sweep (`--sweep-model`); an unknown name is a ConfigError listing the config's models."""
  if not name:
    return []
  models = dict(load(spec).get("sweep", {}).get("models", {}) or {})
  if name not in models:
    raise ConfigError(f"--sweep-model {name!r} is not a model of {label or spec}'s sweep.models; choose from "
                      f"{', '.join(sorted(models)) or 'none (the config has no sweep models)'}")
  return list(models[name])


def resolve(spec: str, overrides=()) -> ExperimentConfig:
  """Config file + overrides -> the typed ExperimentConfig that library code receives."""
  config = apply_overrides(load(spec), overrides)
  return from_dict(config.to_dict())


def split_argv(argv) -> tuple:
  """(--config value, ["key=value" from --config.key=value or --config.key value], the other arguments)."""
  spec, overrides, rest = None, [], []
  i = 0
  while i < len(argv):
    a = argv[i]
    if a == "--config" or a.startswith("--config="):
      if "=" in a:
        spec = a.split("=", 1)[1]
      else:
        i += 1
        spec = argv[i] if i < len(argv) else None
    elif a.startswith("--config."):
      body = a[len("--config."):]
      if "=" not in body:
        i += 1
        if i >= len(argv):
          raise ConfigError(f"{a} needs a value")
        body = f"{body}={argv[i]}"
      overrides.append(body)
    else:
      rest.append(a)
    i += 1
  return spec, overrides, rest
