"""The on-disk format of a checkpoint's step directory: its two orbax items.

- `state`: a standard orbax PyTree of every array of the snapshot, nested by
  name: `experiment_module/params/<haiku module>/w`, `train_step_rng`, ...
  (a NamedTuple's fields by name, a tuple's or list's items by index). It
  holds one copy of pmap-replicated state, without a device axis, and
  reads with orbax alone: `ocp.StandardCheckpointer().restore(<step>/state)`.
- `meta`: JSON with the snapshot's plain Python values, the skeleton each
  entry was made of (`checkpoint_skeleton`), the topology that wrote it, a
  checksum of every array (`checkpoint_fingerprints`) and a digest of the
  JSON itself.

Here: the names of entries and arrays, `encode` (a snapshot into the two
items), the meta record's digest and topology, and the errors a checkpoint
that cannot be written or used is reported with.
"""

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxline_ng import base_config, devices, errors, iterator_state
from jaxline_ng import mesh as mesh_lib
from jaxline_ng.checkpoint_skeleton import PLAIN_VALUES, skeleton_of

FORMAT = 2
STATE_ITEM, META_ITEM = "state", "meta"
META_KEYS = frozenset(("format", "step", "topology", "entries", "arrays", "digest"))
# Attributes the loops keep on the state besides the experiment's own.
STATE_ATTRS = frozenset(("global_step", "train_step_rng", "periodic_action_times", "run_config",
                          "best_eval_metric_value", "best_model_eval_metric"))


# The config key that resumes from a checkpoint holding entries the experiment no longer has.
DROP_EXTRA_KEY = "drop_extra_checkpoint_entries"


class CheckpointFormatError(TypeError, errors.OneLineError):
  """A snapshot value that cannot be stored without pickle; names the entry."""


class UnusableCheckpoint(ValueError):
  """A checkpoint that is damaged or does not fit the experiment; names what."""


class CheckpointRefused(base_config.ConfigError):
  """No checkpoint of a series can be resumed from; the message says why."""


class DoesNotFit(CheckpointRefused):
  """A sound checkpoint whose layout is not the experiment's: the code changed.

  Not damage, so no older checkpoint is tried: one of another layout may
  fit (state that grows, a model changed back), and resuming from it would
  silently roll the run back past the newest save.
  """


def _entry_name(top_key: str, path) -> str:
  return top_key + jax.tree_util.keystr(path)


def _key_name(key) -> str:
  """One level of a key path as a name in the orbax tree."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def orbax_path(entry_name: str, path) -> list[str]:
  """Where the leaf at key path `path` of an entry lives in the orbax tree."""
  return [*entry_name.split("/"), *(_key_name(key) for key in path)]


def named_leaves(entry_name: str, value: Any) -> dict[str, Any]:
  """`value`'s leaves by their orbax names, in the order JAX flattens them."""
  return {"/".join(orbax_path(entry_name, path)): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]}


MODULE_PREFIX = "experiment_module/"


def named_entries(nest: dict[str, Any]) -> dict[str, Any]:
  """A snapshot as flat entries: its own values by name, the experiment's as
  `experiment_module/<checkpoint name>`."""
  module = nest.get("experiment_module") or {}
  return {**{k: v for k, v in nest.items() if k != "experiment_module"},
          **{MODULE_PREFIX + k: v for k, v in module.items()}}


def _unstorable(name: str, path, leaf: Any) -> CheckpointFormatError:
  return CheckpointFormatError(
      f"cannot checkpoint {_entry_name(name, path)}: a {type(leaf).__name__} is neither an array "
      "nor a plain Python value (int, float, bool, str) nor an iterator that reports its "
      "position: hold arrays, or give it get_state() and set_state(state) as grain's iterators "
      "have (a tf.data iterator is saved too; README: Exact resume)")


def is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def encode(nest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list]:
  """Splits a snapshot into the orbax tree of its arrays and JSON entries.

  Returns `(tree, entries, arrays)`: `arrays` lists `(tree path, array)` in
  the order the entries reference them. Raises CheckpointFormatError naming
  the first value that is neither an array nor a plain Python value.
  """
  tree: dict[str, Any] = {}
  entries, arrays, names, stored = {}, [], set(), {}
  for name, value in named_entries(nest).items():
    if isinstance(value, iterator_state.Position):
      entries[name] = _iterator_entry(value)
      continue
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
      key_impl = None
      if devices.is_typed_key(leaf):  # Saved as its raw data, marked with its implementation.
        key_impl, leaf = str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
      if is_array(leaf) and leaf.size == 0:
        # Nothing to write (and orbax refuses it): the entry holds its shape.
        leaves.append({"empty": {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}})
      elif is_array(leaf):
        tree_path = orbax_path(name, path)
        node = tree
        for part in tree_path[:-1]:
          node = node.setdefault(part, {})
          if not isinstance(node, dict):
            raise CheckpointFormatError(f"cannot checkpoint {_entry_name(name, path)}: its "
                                        f"name {'/'.join(tree_path)} is taken by another array")
        if tree_path[-1] in node:
          raise CheckpointFormatError(f"cannot checkpoint {_entry_name(name, path)}: its "
                                      f"name {'/'.join(tree_path)} is taken by another value")
        node[tree_path[-1]] = leaf
        if "/".join(tree_path) in names:
          raise CheckpointFormatError(f"cannot checkpoint {_entry_name(name, path)}: its "
                                      f"name {'/'.join(tree_path)} is taken by another array")
        names.add("/".join(tree_path))
        # Orbax stores each array under its path joined with "."; two that join
        # alike overwrite each other, and the checkpoint fails its checksums.
        stored_as = ".".join(tree_path)
        if stored_as in stored:
          raise CheckpointFormatError(
              f"cannot checkpoint {_entry_name(name, path)}: orbax stores it as {stored_as!r}, "
              f"as it does {stored[stored_as]}; rename a key so that a '.' in it does not "
              "spell another's nesting")
        stored[stored_as] = "/".join(tree_path)
        arrays.append((tree_path, leaf))
        # Marked: orbax gives a NumPy scalar back as a 0-d array.
        leaves.append({"array": tree_path, **({"numpy_scalar": True}
                                              if isinstance(leaf, np.generic) else {}),
                       **({"key_impl": key_impl} if key_impl else {})})
      elif isinstance(leaf, PLAIN_VALUES):
        leaves.append({"value": leaf})
      else:
        raise _unstorable(name, path, leaf)
    entries[name] = {"leaves": leaves, "skeleton": skeleton_of(value)}
  return tree, entries, arrays


def _iterator_entry(position: iterator_state.Position) -> dict[str, Any]:
  """A checkpoint entry holding an iterator's position: one JSON value, marked."""
  return {"leaves": [{"value": position.to_json()}], "skeleton": {"iterator": position.kind}}


def with_peer_positions(entries: dict[str, Any], step: int) -> dict[str, Any]:
  """`entries` with every process's iterator positions at `step` (the chief's save)."""
  positions = {name: iterator_state.Position.from_json(entry["leaves"][0]["value"])
               for name, entry in entries.items() if "iterator" in (entry["skeleton"] or {})}
  if not positions:
    return entries
  gathered = iterator_state.gather(positions, step)
  return {**entries, **{name: _iterator_entry(p) for name, p in gathered.items()}}


def digest(meta: dict[str, Any]) -> str:
  body = {k: v for k, v in meta.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def current_topology() -> dict[str, Any]:
  placement = mesh_lib.placement()
  return {"placement": placement.name,
          "process_count": jax.process_count(),
          "local_device_count": jax.local_device_count(),
          "mesh": placement.mesh_shape,
          "x64": bool(jax.config.jax_enable_x64)}


def warn_if_another_topology(topology: dict[str, Any], step: int) -> None:
  """The key chain continues on any topology (`rng.place_chain`), but each
  device's step keys then differ from the saved run's: say so."""
  now = current_topology()
  if any(topology.get(key, value) != value for key, value in now.items()):
    logging.warning(
        "[jaxline_ng] The checkpoint was saved by %s, this run is %s: training continues from "
        "step %d with the same key chain, but each device's step keys differ from the saved "
        "run's; a resume reproduces an uninterrupted run bit for bit only on the topology that "
        "saved it.", describe_topology(topology), describe_topology(now), step)


def describe_topology(topology: dict[str, Any]) -> str:
  text = (f"{topology['placement']} on {topology['process_count']} process(es) x "
          f"{topology['local_device_count']} device(s)")
  if topology.get("mesh"):
    text += " mesh " + ",".join(f"{k}:{v}" for k, v in topology["mesh"].items())
  return text


def saved_steps(series_dir: str) -> list[int]:
  """Complete checkpoints of a series, oldest first (orbax's temp dirs are not numbers)."""
  if not os.path.isdir(series_dir):
    return []
  return sorted(int(name) for name in os.listdir(series_dir) if name.isdigit())


def unusable_dir(series_dir: str) -> str:
  """Where unusable checkpoints of a series are moved: beside it, never deleted."""
  return series_dir.rstrip(os.sep) + ".unusable"
