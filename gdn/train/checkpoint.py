"""Checkpoints with orbax's CheckpointManager: periodic, keep-N, atomic, verified on restore.

A checkpoint holds three items: "state" (the TrainState as a nested dict of arrays named by their pytree
paths), "data" (the data iterator's state, i.e. the position in the batch stream) and "meta" (step and one
SHA-256 of every array and of the data position, as canonical JSON). Orbax makes a save atomic (written to a
temporary directory, renamed when complete), so a kill mid-save leaves no step directory; the digest catches
what atomicity cannot (bytes changed or lost on disk later, a data position edited by hand). A checkpoint that
fails to load or to match its digest, in its arrays or in its data position, is moved to
`<dir>/../corrupt_checkpoints/<step>` (`<step>.1`, `<step>.2`, ... when that name is taken: nothing there is
ever overwritten) with a warning and the previous one is tried; if every checkpoint fails, restore stops with
`NoUsableCheckpoint` listing them rather than start again from step 0. Checkpoints written before the digest
covered the data position (their meta has no "covers") restore with their arrays verified and the data
position as read.

Several processes: every process calls save and restore (orbax synchronises them). The state is gathered to
every host as whole arrays, an allgather for an array split over other hosts' devices (FSDP across hosts), so
every process computes the same digest and orbax writes the arrays, the data position and the metadata once,
from process 0. The data position is one grain index that every process advances together; save checks that
it is the same everywhere, since a checkpoint keeps one copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


def _name(p) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(p, attr):
      return str(getattr(p, attr))
  return str(p)


def _is_key(leaf) -> bool:
  return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def to_arrays(state) -> dict:
  """The state as a nested dict of numpy arrays keyed by pytree path (PRNG keys as their raw data)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    node = out
    names = [_name(p) for p in path]
    for n in names[:-1]:
      node = node.setdefault(n, {})
    node[names[-1]] = _to_host(jax.random.key_data(leaf) if _is_key(leaf) else leaf)
  return out


def _to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    # Part of it may live only on other hosts' devices. Every process reaches this for the same leaves in the
    # same order (addressability is a property of the mesh), as the collective needs.
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def from_arrays(arrays: dict, template):
  """Inverse of `to_arrays`, shaped like `template`; raises ValueError naming a leaf that does not fit."""
  leaves = []
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  for path, ref in paths:
    names = [_name(p) for p in path]
    node = arrays
    for n in names:
      if not isinstance(node, dict) or n not in node:
        raise ValueError(f"checkpoint has no array {'/'.join(names)}")
      node = node[n]
    value = np.asarray(node)
    want = jax.random.key_data(ref) if _is_key(ref) else ref
    if value.shape != want.shape or value.dtype != want.dtype:
      raise ValueError(f"checkpoint array {'/'.join(names)} is {value.dtype}{list(value.shape)}, "
                       f"the model needs {want.dtype}{list(want.shape)}")
    leaves.append(jax.random.wrap_key_data(value, impl=jax.random.key_impl(ref)) if _is_key(ref)
                  else jax.device_put(value))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _canonical(data_state) -> bytes:
  return json.dumps(data_state, sort_keys=True, separators=(",", ":")).encode()


def digest(arrays: dict, data_state=None) -> str:
  """SHA-256 of every array (path, dtype, shape, bytes) and, if given, of the data state as canonical JSON."""
  h = hashlib.sha256()

  def walk(node, prefix):
    for k in sorted(node):
      if isinstance(node[k], dict):
        walk(node[k], f"{prefix}/{k}")
      else:
        a = np.ascontiguousarray(node[k])
        h.update(f"{prefix}/{k}:{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())

  walk(arrays, "")
  if data_state is not None:
    h.update(b"data:" + _canonical(data_state))
  return h.hexdigest()


class ConfigMismatch(ValueError):
  """The checkpoint is intact but was written for a different model or optimizer."""


class NoUsableCheckpoint(RuntimeError):
  """Every checkpoint in the directory failed to load; each was moved aside."""


class Checkpoints:
  """Saves and restores (TrainState, data position) under one directory."""

  def __init__(self, directory: str, keep: int):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "meta"))

  def save(self, step: int, state, data_state: dict) -> None:
    if jax.process_count() > 1:
      code = np.frombuffer(hashlib.sha256(_canonical(data_state)).digest(), np.uint8)
      multihost_utils.assert_equal(code, f"the data iterator state differs between processes at step {step}: "
                                         f"{data_state} in process {jax.process_index()}")
    arrays = to_arrays(state)
    meta = dict(step=int(step), digest=digest(arrays, data_state), covers=["state", "data"])
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(arrays), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

  def _arrays(self, step: int, template=None):
    """(arrays, data state) of checkpoint `step`, checked against their digest; without a template the
    arrays are read as saved."""
    state_args = ocp.args.StandardRestore(None if template is None else to_arrays(template))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=state_args, data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    arrays = jax.tree_util.tree_map(np.asarray, dict(restored["state"]))
    meta, data_state = restored["meta"], restored["data"]
    if "data" in meta.get("covers", ()):
      if meta.get("step") != step or digest(arrays, data_state) != meta.get("digest"):
        raise IOError("its arrays or data position do not match the digest written with them")
    elif meta.get("step") != step or digest(arrays) != meta.get("digest"):  # written before "covers"
      raise IOError("its arrays do not match the digest written with them")
    return arrays, data_state

  def _load(self, step: int, template):
    arrays, data_state = self._arrays(step, template)
    try:
      state = from_arrays(arrays, template)
    except ValueError as e:
      raise ConfigMismatch(str(e)) from None
    return state, data_state

  def restore_params(self, template):
    """The parameters of the newest intact checkpoint, shaped like `template` (a TrainState's params), and its
    step; a damaged one is skipped with a warning (left in place: the caller sets the whole run aside). Raises
    ConfigMismatch naming an array the model does not have, FileNotFoundError if there is no checkpoint,
    NoUsableCheckpoint if none is intact."""
    self.manager.reload()
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    failed = []
    for step in steps:
      try:
        arrays, _ = self._arrays(step)
      except Exception as e:  # as in restore_latest
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"checkpoint {step} in {self.directory} is corrupt or partial ({reason}); "
                      "trying the previous one")
        failed.append(f"step {step} ({reason})")
        continue
      try:
        return from_arrays(arrays["params"], template), step
      except ValueError as e:
        raise ConfigMismatch(f"checkpoint {step} in {self.directory}: {e}") from None
    raise NoUsableCheckpoint(f"train.resume='params_only' found no intact checkpoint in {self.directory}: "
                             f"{'; '.join(failed)}. Use train.resume=fresh to start without them")

  def restore_latest(self, template):
    """(state, data_state, step) from the newest good checkpoint, or None if there is none. A bad one is moved
    aside and the previous one tried; raises NoUsableCheckpoint if there were checkpoints and none was good."""
    self.manager.reload()
    failed = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state, data_state = self._load(step, template)
        return state, data_state, step
      except ConfigMismatch as e:
        raise ConfigMismatch(f"checkpoint {step} in {self.directory} was written by a different config ({e}); "
                             "use a fresh workdir or the original config") from None
      except Exception as e:  # orbax, tensorstore and json raise many types for damaged files
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        aside = self._move_aside(step)
        warnings.warn(f"checkpoint {step} in {self.directory} is corrupt or partial ({reason}); moved it to "
                      f"{aside}, trying the previous one")
        failed.append(f"step {step} ({reason}; moved to {aside})")
    if failed:
      raise NoUsableCheckpoint(
          f"none of the {len(failed)} checkpoint(s) in {self.directory} could be restored: {'; '.join(failed)}. "
          "Nothing was trained. Restore a good copy, or start again with --config.train.resume=fresh "
          "(sets the previous run aside)")
    return None

  def _move_aside(self, step: int) -> str:
    """Moves checkpoint `step` to a free name under `<dir>/../corrupt_checkpoints/`; returns where."""
    root = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
    aside, n = os.path.join(root, str(step)), 0
    while os.path.exists(aside):  # an earlier copy of this step: keep it
      n += 1
      aside = os.path.join(root, f"{step}.{n}")
    # Every process names the same place before one of them moves it there (the directory is shared).
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} to move aside")
    if jax.process_index() == 0:
      os.makedirs(root, exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
    self.manager.reload()
    return aside

  def latest_step(self):
    return self.manager.latest_step()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
