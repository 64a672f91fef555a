"""Reading PyTorch-world weights (state_dicts, safetensors files) and writing them into NNX modules.

Every tensor becomes a float32 NumPy array: our parameters are float32 whatever the checkpoint's dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Mapping, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx


def to_numpy(x) -> np.ndarray:
  """A torch tensor (any device, bfloat16 included), a JAX array or a NumPy array, as float32 NumPy."""
  if hasattr(x, "detach"):  # torch, without importing it: NumPy has no bfloat16, so widen in torch first
    x = x.detach().cpu()
    if x.is_floating_point():
      x = x.float()
    return x.numpy().astype(np.float32)
  return np.asarray(x).astype(np.float32)


def _safetensors_files(path: str) -> tuple:
  """(files, key -> file or None) for a .safetensors file, a sharded index .json, or a folder holding either."""
  if os.path.isdir(path):
    index = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors.index.json")]
    shards = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    if index:
      return _safetensors_files(os.path.join(path, index[0]))
    if not shards:
      raise FileNotFoundError(f"source folder {path!r} holds no .safetensors file nor a .safetensors.index.json")
    return tuple(os.path.join(path, f) for f in shards), None
  if path.endswith(".json"):
    with open(path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"source {path!r} is not a safetensors index: it has no 'weight_map' object")
    folder = os.path.dirname(path)
    key_to_file = {k: os.path.join(folder, v) for k, v in weight_map.items()}
    return tuple(sorted(set(key_to_file.values()))), key_to_file
  if not os.path.exists(path):
    raise FileNotFoundError(f"source {path!r} does not exist")
  return (path,), None


def read_safetensors(path, prefix: str = "") -> dict:
  """The tensors whose names start with `prefix` (prefix removed) from a .safetensors file, a sharded checkpoint's
  index .json, or a folder holding either; only the shards that hold such tensors are opened."""
  try:
    from safetensors import safe_open
  except ImportError as e:
    raise ImportError("reading safetensors files needs the 'safetensors' package: pip install -e '.[interop]'") from e
  files, key_to_file = _safetensors_files(os.fspath(path))
  if key_to_file is not None:
    files = sorted({f for k, f in key_to_file.items() if k.startswith(prefix)})
  out = {}
  for file in files:
    # "flax" rather than "numpy": NumPy cannot hold the bfloat16 tensors that most checkpoints store.
    with safe_open(file, framework="flax") as f:
      for key in f.keys():
        if key.startswith(prefix):
          out[key[len(prefix):]] = to_numpy(f.get_tensor(key))
  return out


def source_keys(source) -> list:
  """Every tensor name of a state_dict (a mapping) or a safetensors file, index or folder, without reading data."""
  if isinstance(source, Mapping):
    return sorted(k for k in source if isinstance(k, str))
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f"state_dict must be a mapping of names to tensors or a safetensors path, "
                    f"got {type(source).__name__}")
  files, key_to_file = _safetensors_files(os.fspath(source))
  if key_to_file is not None:
    return sorted(key_to_file)
  from safetensors import safe_open
  keys = []
  for file in files:
    with safe_open(file, framework="flax") as f:
      keys += list(f.keys())
  return sorted(keys)


class Tensors:
  """A state_dict being consumed: `take` each tensor once, then `check_consumed` names whatever is left over, so a
  tensor our module has no place for (a conv bias, say) is an error rather than silently dropped."""

  def __init__(self, source, prefix: str = "", *, name: str = "state_dict"):
    if not isinstance(prefix, str):
      raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    self.prefix = prefix
    self.name = name
    if isinstance(source, (str, os.PathLike)):
      self.name = f"safetensors {os.fspath(source)!r}"
      self._arrays = read_safetensors(source, prefix)
    elif isinstance(source, Mapping):
      self._arrays = {k[len(prefix):]: v for k, v in source.items() if isinstance(k, str) and k.startswith(prefix)}
    else:
      raise TypeError(f"state_dict must be a mapping of names to tensors or a safetensors path, "
                      f"got {type(source).__name__}")
    if not self._arrays:
      raise KeyError(f"{self.name} has no tensor whose name starts with prefix {prefix!r}")
    self._taken = set()

  def __contains__(self, key: str) -> bool:
    return key in self._arrays

  def keys(self) -> list:
    return sorted(self._arrays)

  def shape(self, key: str) -> tuple:
    return tuple(self._get(key).shape)

  def _get(self, key: str):
    if key not in self._arrays:
      raise KeyError(f"{self.name} is missing {self.prefix + key!r} (prefix {self.prefix!r}); it has "
                     f"{sorted(self.prefix + k for k in self._arrays)}")
    return self._arrays[key]

  def take(self, key: str, shape: Optional[Iterable[int]] = None) -> np.ndarray:
    """The tensor `key` as float32 NumPy, checked against `shape` when given."""
    x = to_numpy(self._get(key))
    if shape is not None and x.shape != tuple(shape):
      raise ValueError(f"{self.name}[{self.prefix + key!r}] has shape {x.shape}, expected {tuple(shape)}")
    self._taken.add(key)
    return x

  def check_consumed(self) -> None:
    left = sorted(set(self._arrays) - self._taken)
    if left:
      raise ValueError(f"{self.name} has tensors with no counterpart in our module: "
                       f"{[self.prefix + k for k in left]}")


def linear(t: Tensors, name: str, n_in: int, n_out: int, *, bias: bool = False) -> dict:
  """nnx.Linear params from torch's nn.Linear: kernel [in, out] is weight [out, in] transposed."""
  out = {"kernel": t.take(f"{name}.weight", (n_out, n_in)).T}
  if bias:
    out["bias"] = t.take(f"{name}.bias", (n_out,))
  return out


def flatten(tree: Mapping, path: tuple = ()) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, path + (k,)))
    else:
      out[path + (k,)] = v
  return out


def assign(module: nnx.Module, params: Mapping) -> nnx.Module:
  """Write nested `params` (NumPy arrays) into `module`'s nnx.Param's, in place.

  Every Param of the module must be given, with its exact shape: a module built from another config is an error.
  """
  flat = flatten(params)
  ours = {tuple(path): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}
  missing = sorted(".".join(map(str, p)) for p in set(ours) - set(flat))
  extra = sorted(".".join(map(str, p)) for p in set(flat) - set(ours))
  if missing or extra:
    raise ValueError(f"module parameters do not match the imported ones: missing {missing}, unexpected {extra}")
  for path, value in flat.items():
    var = _variable(module, path)
    if tuple(var.shape) != tuple(value.shape):
      raise ValueError(f"module parameter {'.'.join(map(str, path))} has shape {tuple(var.shape)}, the imported "
                       f"tensor {tuple(value.shape)}")
    var.set_value(jnp.asarray(value, var.get_value().dtype))
  return module


def _variable(module, path):
  obj = module
  for k in path:
    obj = obj[k] if isinstance(k, int) else getattr(obj, k)
  return obj


def field(config, name: str, default=...):
  """`config[name]` for a dict (a config.json) or `config.name` for a config object; a clear error if absent."""
  if isinstance(config, Mapping):
    if name in config:
      return config[name]
  elif hasattr(config, name):
    return getattr(config, name)
  if default is ...:
    raise KeyError(f"config has no field {name!r}")
  return default


# Config fields that change neither the parameters nor the outputs of an imported layer.
FREE_FIELDS = ("method", "chunk_size", "local_groups", "dropout", "dt_init", "implementation", "remat")


def target(module, build, cfg, d_model: int):
  """A new module from `build()`, or `module` checked to have been built from `cfg` and `d_model` (up to
  `FREE_FIELDS`)."""
  if module is None:
    return build()
  have = getattr(module, "cfg", None)
  if type(have) is not type(cfg):
    raise TypeError(f"module must be built from a {type(cfg).__name__}, got {type(module).__name__}")
  diff = [f.name for f in dataclasses.fields(cfg)
          if f.name not in FREE_FIELDS and getattr(have, f.name) != getattr(cfg, f.name)]
  if diff:
    raise ValueError(f"module's config differs from the imported layer's in {diff}: "
                     f"{ {k: (getattr(have, k), getattr(cfg, k)) for k in diff} } (module, imported)")
  if module.d_model != d_model:
    raise ValueError(f"module has d_model={module.d_model}, the imported layer {d_model}")
  return module
