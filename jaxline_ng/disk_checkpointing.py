"""Durable checkpoints on disk, as native orbax checkpoints.

Select with `config.checkpointer = "disk"`. Each series (`latest`, `best`)
lives in `<checkpoint_dir>/checkpoints/<series>/<step>/`, the newest
`max_checkpoints_to_keep` kept. A step directory holds two orbax items:

- `state`: a standard orbax PyTree of every array of the snapshot, nested by
  name: `experiment_module/params/<haiku module>/w`, `train_step_rng`, ...
  (a NamedTuple's fields by name, a tuple's or list's items by index). It
  holds one copy of pmap-replicated state, without a device axis, and
  reads with orbax alone: `ocp.StandardCheckpointer().restore(<step>/state)`.
- `meta`: JSON with the snapshot's plain Python values, the skeleton each
  entry was made of (dicts, lists, tuples; NamedTuples, other Mappings and
  pytree dataclasses by class name), the topology that wrote it, a checksum
  of every array (`fingerprint`) and a digest of the JSON itself.

Saving takes fresh on-device copies of the state on the calling thread (so
donation and later steps cannot change them) and dispatches each array's
checksum there; on a background thread the non-finite guard's check runs
(it may veto the save), then orbax writes. Arrays go to orbax as they are:
in mesh mode every process writes the shards it holds. Orbax writes into a
temporary directory and renames it when complete, so a process killed at any
moment leaves only complete step directories.

Restoring executes nothing from the checkpoint (no pickle). Arrays are read
straight onto the shardings the live experiment has (orbax reshards onto
another mesh) or, in pmap mode, as one host copy replicated onto however many
devices this process has. A checkpoint whose checksums or digest do not
match, or that does not parse, is reported and the one before it used; the
training job then moves the bad one aside (kept, under `<series>.unusable/`)
so later saves go past its step. One that is sound but does not fit the
experiment (entries, names or shapes the code no longer has) is refused.
"""

import collections
import dataclasses
import errno
import hashlib
import json
import logging as python_logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxline_ng import (
  background,
  base_config,
  checkpointing,
  debugging,
  devices,
  iterator_state,
  multihost,
  rng,
)
from jaxline_ng import mesh as mesh_lib

FORMAT = 2
_STATE_ITEM, _META_ITEM = "state", "meta"
_META_KEYS = frozenset(("format", "step", "topology", "entries", "arrays", "digest"))
# Attributes the loops keep on an ExperimentState besides the experiment's own.
_STATE_ATTRS = frozenset(("global_step", "train_step_rng", "periodic_action_times", "run_config",
                          "best_eval_metric_value", "best_model_eval_metric"))
_PLAIN_VALUES = (bool, int, float, str)
# The config key that resumes from a checkpoint holding entries the experiment no longer has.
DROP_EXTRA_KEY = "drop_extra_checkpoint_entries"


def _drop_orbax_info(record: python_logging.LogRecord) -> bool:
  """A filter for absl's logger, added by the first DiskCheckpointer: orbax
  logs each phase of every save at INFO through absl, a dozen lines a save,
  and jaxline_ng logs each save in one line. Orbax's warnings pass."""
  return record.levelno >= python_logging.WARNING or \
      f"{os.sep}orbax{os.sep}" not in record.pathname


class CheckpointFormatError(TypeError):
  """A snapshot value that cannot be stored without pickle; names the entry."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


class UnusableCheckpoint(ValueError):
  """A checkpoint that is damaged or does not fit the experiment; names what."""


class CheckpointWriteError(OSError):
  """The filesystem refused a save (full, read-only, gone); names the directory."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


# How TensorStore, which writes orbax's arrays, names the OS error behind a
# failed write in the ValueError it raises: "... [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_error_code(error: Exception) -> int | None:
  """The errno behind a failed save: an OSError's, or the one TensorStore's message names."""
  if isinstance(error, OSError):
    return error.errno
  found = _OS_ERROR_CODE.search(str(error))
  return int(found.group(1)) if found else None


class CheckpointRefused(base_config.ConfigError):
  """No checkpoint of a series can be resumed from; the message says why."""


class _DoesNotFit(CheckpointRefused):
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


def _tree_path(entry_name: str, path) -> list[str]:
  """Where the leaf at key path `path` of an entry lives in the orbax tree."""
  return [*entry_name.split("/"), *(_key_name(key) for key in path)]


def _named_leaves(entry_name: str, value: Any) -> dict[str, Any]:
  """`value`'s leaves by their orbax names, in the order JAX flattens them."""
  return {"/".join(_tree_path(entry_name, path)): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]}


def _skeleton(value: Any) -> Any:
  """A JSON description of `value`'s containers, or None if it has other nodes.

  Leaves become {"leaf": i} (their index among the entry's leaves), so the
  skeleton plus the leaves rebuild the value. A NamedTuple (an optax state),
  a Mapping flattened as a dict (haiku's FlatMap) or a dataclass registered
  as a pytree of its fields (kfac-jax's optimizer state) is described by its
  class's name: jaxline experiments often build such state in the first
  step unless a restore already set it, so a restore must recreate it
  without a live value to copy the structure from.
  """
  counter = iter(range(1 << 62))

  def describe(node):
    if node is None:
      return {"none": True}
    if isinstance(node, dict):
      if not all(isinstance(k, str) for k in node):
        raise TypeError
      if isinstance(node, collections.OrderedDict):  # JAX keeps its order; a dict's, sorted.
        return {"ordered_dict": [[k, describe(v)] for k, v in node.items()]}
      return {"dict": {k: describe(node[k]) for k in sorted(node)}}
    if type(node) in (list, tuple):
      return {type(node).__name__: [describe(v) for v in node]}
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
      return {"namedtuple": _class_name(node), "fields": [describe(v) for v in node]}
    if isinstance(node, Mapping) and _flattens_as_a_dict(node):
      return {"mapping": _class_name(node), "dict": {k: describe(node[k]) for k in sorted(node)}}
    names = _pytree_dataclass_fields(node)
    if names is not None:
      return {"dataclass": _class_name(node),
              "fields": [[name, describe(getattr(node, name))] for name in names]}
    if isinstance(node, (jax.Array, np.ndarray, np.generic, *_PLAIN_VALUES)):
      return {"leaf": next(counter)}
    raise TypeError

  try:
    return describe(value)
  except TypeError:
    return None


def _class_name(node: Any) -> str:
  return f"{type(node).__module__}:{type(node).__qualname__}"


def _init_fields(node_or_class: Any) -> list[str]:
  return [field.name for field in dataclasses.fields(node_or_class) if field.init]


def _flattens_as_a_dict(mapping: Mapping) -> bool:
  """Whether JAX flattens `mapping` (another Mapping than a dict: haiku's
  FlatMap, flax's FrozenDict) as a dict of its items, with string keys: into
  its values' leaves in sorted-key order, which its skeleton then follows."""
  if not all(isinstance(key, str) for key in mapping):
    return False
  leaves = jax.tree.leaves(mapping)
  by_key = [leaf for key in sorted(mapping) for leaf in jax.tree.leaves(mapping[key])]
  return len(leaves) == len(by_key) and all(a is b for a, b in zip(leaves, by_key))


def _pytree_dataclass_fields(node: Any) -> list[str] | None:
  """`node`'s field names in the order JAX flattens them, if `node` is a
  dataclass that JAX flattens into exactly the fields its constructor takes
  (so `cls(**fields)` rebuilds it); else None. Fields that JAX keeps as static
  metadata are not arrays a checkpoint could hold."""
  if not dataclasses.is_dataclass(node) or isinstance(node, type):
    return None
  fields = _init_fields(node)
  children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
  if len(children) != len(fields) or any(len(path) != 1 for path, _ in children):
    return None
  # Keys name the fields (chex sorts them); keys by position follow the class's order.
  names = [path[0].name if isinstance(path[0], jax.tree_util.GetAttrKey) else field
           for (path, _), field in zip(children, fields)]
  if sorted(names) != sorted(fields) or any(
      getattr(node, name) is not child for name, (_, child) in zip(names, children)):
    return None
  return names


class _NotRebuilt(LookupError):
  """A skeleton's class is not among this program's imported classes, or does
  not rebuild; the message says which, following "its"."""


def _imported_class(kind: str, name: str, fits: Callable[[type], bool]) -> type:
  """The class `module:qualname` (a `kind`), looked up in the modules already
  imported (a checkpoint never makes the program import anything), if it `fits`."""
  module_name, _, qualname = name.partition(":")
  cls = sys.modules.get(module_name)
  for part in qualname.split("."):
    cls = getattr(cls, part, None)
  if not (isinstance(cls, type) and fits(cls)):
    raise _NotRebuilt(f"{kind} {name} is not imported (or has other fields)")
  return cls


def _constructed(described: str, source: str, construct: Callable[[], Any],
                 flattens_as_saved: Callable[[Any], bool], otherwise: str) -> Any:
  """`construct()`, the experiment's class built from restored values, if JAX
  still flattens it as it did when saved; raises _NotRebuilt saying why not."""
  try:
    value = construct()
  except (TypeError, ValueError) as e:  # A constructor of its own, a __post_init__ check.
    raise _NotRebuilt(f"{described} does not rebuild from {source} "
                      f"({type(e).__name__}: {e})") from None
  if not flattens_as_saved(value):
    raise _NotRebuilt(f"{described} is not imported (or {otherwise})")
  return value


def _rebuild(skeleton: Any, leaves: list) -> Any:
  """The value `skeleton` describes, with `leaves`; raises _NotRebuilt."""
  if "namedtuple" in skeleton:
    cls = _imported_class("NamedTuple class", skeleton["namedtuple"], lambda cls: issubclass(
        cls, tuple) and len(getattr(cls, "_fields", ())) == len(skeleton["fields"]))
    return cls(*(_rebuild(v, leaves) for v in skeleton["fields"]))
  if "dataclass" in skeleton:
    names = [name for name, _ in skeleton["fields"]]
    cls = _imported_class("dataclass", skeleton["dataclass"],
                          lambda cls: dataclasses.is_dataclass(cls)
                          and sorted(_init_fields(cls)) == sorted(names))
    # Field by field by name: the class may declare them in another order now.
    return _constructed(
        f"dataclass {skeleton['dataclass']}", "its fields",
        lambda: cls(**{name: _rebuild(v, leaves) for name, v in skeleton["fields"]}),
        lambda value: _pytree_dataclass_fields(value) is not None, "has other fields")
  if "mapping" in skeleton:
    cls = _imported_class("Mapping class", skeleton["mapping"],
                          lambda cls: issubclass(cls, Mapping))
    return _constructed(
        f"Mapping class {skeleton['mapping']}", "a dict",
        lambda: cls({key: _rebuild(v, leaves) for key, v in skeleton["dict"].items()}),
        _flattens_as_a_dict, "flattens otherwise")
  if "none" in skeleton:
    return None
  if "iterator" in skeleton:
    return iterator_state.Position.from_json(leaves[0])
  if "leaf" in skeleton:
    return leaves[skeleton["leaf"]]
  if "dict" in skeleton:
    return {k: _rebuild(v, leaves) for k, v in skeleton["dict"].items()}
  if "ordered_dict" in skeleton:
    return collections.OrderedDict((k, _rebuild(v, leaves)) for k, v in skeleton["ordered_dict"])
  if "list" in skeleton:
    return [_rebuild(v, leaves) for v in skeleton["list"]]
  return tuple(_rebuild(v, leaves) for v in skeleton["tuple"])


def _names_classes(skeleton: Any) -> bool:
  """Whether `skeleton` names a class, which only the experiment's program has."""
  if "namedtuple" in skeleton or "dataclass" in skeleton or "mapping" in skeleton:
    return True
  children = (skeleton.get("list") or skeleton.get("tuple") or skeleton.get("dict", {}).values()
              or [child for _, child in skeleton.get("ordered_dict", ())])
  return any(_names_classes(child) for child in children)


_MODULE_PREFIX = "experiment_module/"


def _named_entries(nest: dict[str, Any]) -> dict[str, Any]:
  """A snapshot as flat entries: its own values by name, the experiment's as
  `experiment_module/<checkpoint name>`."""
  module = nest.get("experiment_module") or {}
  return {**{k: v for k, v in nest.items() if k != "experiment_module"},
          **{_MODULE_PREFIX + k: v for k, v in module.items()}}


def _unstorable(name: str, path, leaf: Any) -> CheckpointFormatError:
  return CheckpointFormatError(
      f"cannot checkpoint {_entry_name(name, path)}: a {type(leaf).__name__} is neither an array "
      "nor a plain Python value (int, float, bool, str) nor an iterator that reports its "
      "position: hold arrays, or give it get_state() and set_state(state) as grain's iterators "
      "have (a tf.data iterator is saved too; README: Exact resume)")


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def encode(nest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list]:
  """Splits a snapshot into the orbax tree of its arrays and JSON entries.

  Returns `(tree, entries, arrays)`: `arrays` lists `(tree path, array)` in
  the order the entries reference them. Raises CheckpointFormatError naming
  the first value that is neither an array nor a plain Python value.
  """
  tree: dict[str, Any] = {}
  entries, arrays, names = {}, [], set()
  for name, value in _named_entries(nest).items():
    if isinstance(value, iterator_state.Position):
      entries[name] = _iterator_entry(value)
      continue
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
      key_impl = None
      if devices.is_typed_key(leaf):  # Saved as its raw data, marked with its implementation.
        key_impl, leaf = str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
      if _is_array(leaf) and leaf.size == 0:
        # Nothing to write (and orbax refuses it): the entry holds its shape.
        leaves.append({"empty": {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}})
      elif _is_array(leaf):
        tree_path = _tree_path(name, path)
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
        arrays.append((tree_path, leaf))
        # Marked: orbax gives a NumPy scalar back as a 0-d array.
        leaves.append({"array": tree_path, **({"numpy_scalar": True}
                                              if isinstance(leaf, np.generic) else {}),
                       **({"key_impl": key_impl} if key_impl else {})})
      elif isinstance(leaf, _PLAIN_VALUES):
        leaves.append({"value": leaf})
      else:
        raise _unstorable(name, path, leaf)
    entries[name] = {"leaves": leaves, "skeleton": _skeleton(value)}
  return tree, entries, arrays


def _iterator_entry(position: iterator_state.Position) -> dict[str, Any]:
  """A checkpoint entry holding an iterator's position: one JSON value, marked."""
  return {"leaves": [{"value": position.to_json()}], "skeleton": {"iterator": position.kind}}


def _with_peer_positions(entries: dict[str, Any], step: int) -> dict[str, Any]:
  """`entries` with every process's iterator positions at `step` (the chief's save)."""
  positions = {name: iterator_state.Position.from_json(entry["leaves"][0]["value"])
               for name, entry in entries.items() if "iterator" in (entry["skeleton"] or {})}
  if not positions:
    return entries
  gathered = iterator_state.gather(positions, step)
  return {**entries, **{name: _iterator_entry(p) for name, p in gathered.items()}}


def _words(x):
  """`x`'s bits as uint32 words (elementwise, plus a trailing axis for 8-byte types)."""
  if jnp.iscomplexobj(x):
    return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  carrier = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = x if x.dtype == carrier else jax.lax.bitcast_convert_type(x, carrier)
  return bits.astype(jnp.uint32)


@debugging.compiled
def _fingerprints(arrays):
  """Two position-weighted sums of each array's bits, mod 2**32: a checksum of
  the global value that does not depend on how it is sharded (integer sums
  reduce in any order), computed where the array lives, without a gather."""
  results = []
  for x in arrays:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
      index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = words ^ (words >> jnp.uint32(15))
    results.append(jnp.stack([
        jnp.sum(words * (odd * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32),
        jnp.sum(mixed * (odd * jnp.uint32(0x85EBCA77)), dtype=jnp.uint32)]))
  return results


def dispatch_fingerprints(arrays: list) -> list:
  """`_fingerprints` of arrays wherever they are: one dispatch per device set.

  Host arrays are checksummed on the default device.
  """
  results: list = [None] * len(arrays)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(arrays):
    key = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None
    groups.setdefault(key, []).append(i)
  for indices in groups.values():
    for i, result in zip(indices, _fingerprints([arrays[i] for i in indices])):
      results[i] = result
  return results


def _host_fingerprints(fingerprints: list) -> list[list[int]]:
  return [[int(v) for v in np.asarray(h)] for h in devices.first_copy_to_host(fingerprints)]


def _digest(meta: dict[str, Any]) -> str:
  body = {k: v for k, v in meta.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _topology() -> dict[str, Any]:
  mesh = mesh_lib.active_mesh()
  return {"placement": "pmap" if mesh is None else "mesh",
          "process_count": jax.process_count(),
          "local_device_count": jax.local_device_count(),
          "mesh": None if mesh is None else dict(mesh.shape),
          "x64": bool(jax.config.jax_enable_x64)}


def _warn_if_another_topology(topology: dict[str, Any], step: int) -> None:
  """The key chain continues on any topology (`rng.place_chain`), but each
  device's step keys then differ from the saved run's: say so."""
  now = _topology()
  if any(topology.get(key, value) != value for key, value in now.items()):
    logging.warning(
        "[jaxline_ng] The checkpoint was saved by %s, this run is %s: training continues from "
        "step %d with the same key chain, but each device's step keys differ from the saved "
        "run's; a resume reproduces an uninterrupted run bit for bit only on the topology that "
        "saved it.", _describe_topology(topology), _describe_topology(now), step)


def _describe_topology(topology: dict[str, Any]) -> str:
  text = (f"{topology['placement']} on {topology['process_count']} process(es) x "
          f"{topology['local_device_count']} device(s)")
  if topology.get("mesh"):
    text += " mesh " + ",".join(f"{k}:{v}" for k, v in topology["mesh"].items())
  return text


def _steps(series_dir: str) -> list[int]:
  """Complete checkpoints of a series, oldest first (orbax's temp dirs are not numbers)."""
  if not os.path.isdir(series_dir):
    return []
  return sorted(int(name) for name in os.listdir(series_dir) if name.isdigit())


def _processes(together: bool) -> ocp.options.MultiprocessingOptions:
  """The processes an orbax checkpointer involves: this one alone, or every one `together`.

  Orbax's default (every process, no names) synchronises with a device
  collective, which a training thread's collectives can block or interleave
  with (in `train_eval_multithreaded` a restore timed out). Alone, there is
  no barrier; naming the processes makes orbax's saves wait at the
  distributed runtime's barrier instead.
  """
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(
      primary_host=0 if together else me,
      active_processes=set(range(jax.process_count())) if together else {me})


def _reader() -> ocp.Checkpointer:
  """An orbax reader for this process alone, whatever the arrays' sharding.

  Orbax's barriers for processes reading together would wait for a process
  that failed before reaching them (a checkpoint rotated out under it), so
  processes reading arrays sharded over them each read their part alone and
  then agree on the outcome (`_load`).
  """
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                          multiprocessing_options=_processes(together=False))


def _read_meta(path: str) -> dict[str, Any]:
  """The checked JSON of a step directory; raises UnusableCheckpoint (or
  CheckpointRefused for another format) saying what is wrong."""
  if not os.path.lexists(path):  # A mistyped restore_path.
    raise UnusableCheckpoint("it does not exist")
  if os.path.isdir(os.path.join(path, "arrays")) and not os.path.isdir(
      os.path.join(path, _STATE_ITEM)):
    raise CheckpointRefused(
        f"checkpoint {path} is in jaxline_ng's format 1 (items arrays/ and meta/, arrays "
        f"numbered); this version reads format {FORMAT} (a named orbax tree in state/). Resume "
        "it with the jaxline_ng that wrote it, or start a fresh run from its weights")
  if not os.path.isdir(os.path.join(path, _META_ITEM)):
    raise UnusableCheckpoint(f"it is not a checkpoint: it has no {_META_ITEM}/ item")
  try:
    meta = _reader().restore(
        os.path.abspath(path), args=ocp.args.Composite(**{_META_ITEM: ocp.args.JsonRestore()})
    )[_META_ITEM]
  except Exception as e:  # pylint: disable=broad-except  (any damage makes it unusable)
    raise UnusableCheckpoint(f"its metadata does not load ({type(e).__name__}: {e})") from None
  if not isinstance(meta, dict) or set(meta) != _META_KEYS:
    keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
    raise UnusableCheckpoint(f"its metadata has the entries {keys}, expected "
                             f"{sorted(_META_KEYS)}")
  if meta["format"] != FORMAT:
    raise CheckpointRefused(f"checkpoint {path} has format {meta['format']!r}; this version "
                            f"reads format {FORMAT}")
  if meta["digest"] != _digest(meta):
    raise UnusableCheckpoint("its metadata does not match the digest written with it "
                             "(changed or damaged after saving)")
  return meta


def _in_live_order(entry: dict[str, Any], leaves: list, live: Any, name: str) -> list:
  """An entry's `leaves` in the order of the live value's, matched by name.

  A key or field renamed since the save would otherwise hand its arrays to
  whichever leaf now sorts in its place (two layers of one shape would swap
  weights): names that differ do not fit. Fields reordered are matched up.
  """
  saved = ["/".join(leaf["array"]) if "array" in leaf else None for leaf in entry["leaves"]]
  live_names = list(_named_leaves(name, live))
  if all(saved_name in (None, live_name) for saved_name, live_name in zip(saved, live_names)):
    return leaves
  if None not in saved and sorted(saved) == sorted(live_names):
    position = {saved_name: i for i, saved_name in enumerate(saved)}
    return [leaves[position[live_name]] for live_name in live_names]
  gone = sorted(set(saved) - set(live_names) - {None})
  new = sorted(set(live_names) - set(saved))
  raise _DoesNotFit(f"entry {name} holds {', '.join(gone) or 'other values'} where the "
                    f"experiment's has {', '.join(new) or 'other values'}")


def _some(names: list[str]) -> str:
  """Up to three of `names`, and how many more."""
  more = f" and {len(names) - 3} more" if len(names) > 3 else ""
  return ", ".join(names[:3]) + more


def _per_device_elsewhere(live_leaf: jax.Array, shape: tuple[int, ...],
                          meta: dict[str, Any]) -> bool:
  """Whether `live_leaf` holds a row per local device (pmap) and the saved
  value one per device of another count: it cannot run on this topology.

  A row per device is the pmap layout, or, on one device, a leading axis
  as long as the device count here where the saved one was as long as the
  saving run's (`jnp.zeros((jax.local_device_count(),))` in `__init__`).
  """
  saved_devices = meta["topology"].get("local_device_count")
  if (mesh_lib.active_mesh() is not None or shape[:1] != (saved_devices,)
      or live_leaf.shape[:1] in ((), (saved_devices,))):
    return False
  return 0 in devices.split_axes(live_leaf) or (
      live_leaf.shape[0] == _topology()["local_device_count"]
      and live_leaf.shape[1:] == shape[1:])


_ABSENT = object()


def _child(node: Any, key: Any) -> Any:
  """`node`'s child at one level `key` of a key path, or `_ABSENT`."""
  if isinstance(key, jax.tree_util.DictKey):
    return node.get(key.key, _ABSENT) if isinstance(node, Mapping) else _ABSENT
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx] if isinstance(node, (list, tuple)) and key.idx < len(node) else _ABSENT
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name, _ABSENT)
  return _ABSENT


def _grew_into(live: Any, path) -> bool:
  """Whether a saved leaf at key `path`, which the live value lacks, is state
  that grew as the run trained: appended to a list, or in an empty dict (or
  None) that `__init__` built to be filled. Elsewhere (a NamedTuple's other
  fields, a dict of other arrays) it is a leftover of code changed since."""
  node = live
  for key in path:
    child = _child(node, key)
    if child is _ABSENT:
      break
    node = child
  return node is None or type(node) is list or (
      type(node) in (dict, collections.OrderedDict) and not jax.tree.leaves(node))


def _without_extras(name: str, value: Any, live: Any, drop_extra: bool) -> Any:
  """`value` (saved) for training to resume, unless it holds leaves the live
  value lacks that are no state that grew: those are refused, or with
  `drop_extra` left out (a warning names them). Training would carry them
  in every later save."""
  live_leaves = _named_leaves(name, live)
  saved = {"/".join(_tree_path(name, path)): (path, leaf)
           for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]}
  extra = [leaf_name for leaf_name, (path, _) in saved.items()
           if leaf_name not in live_leaves and not _grew_into(live, path)]
  if not extra:
    return value
  if not drop_extra:
    raise _DoesNotFit(f"entry {name} holds {_some(extra)}, which the experiment's does not "
                      f"have (config.{DROP_EXTRA_KEY}=True resumes without them)")
  logging.warning("[jaxline_ng] Not restored (config.%s): %s, which the experiment's %s does "
                  "not have.", DROP_EXTRA_KEY, _some(extra), name)
  return jax.tree.unflatten(jax.tree.structure(live), [
      saved[leaf_name][1] if leaf_name in saved else leaf
      for leaf_name, leaf in live_leaves.items()])


def _value_for(entry: dict[str, Any], leaves: list, live: Any, name: str,
               training: bool, drop_extra: bool = False) -> Any:
  """An entry's value: rebuilt from its skeleton, else in the live value's structure.

  An entry the experiment holds as None is restored when its skeleton
  rebuilds it, as jaxline restores every checkpointed attribute. When it
  cannot be (a type other than containers and imported classes), an
  evaluation mode keeps None (an optimizer state it does not use) with a
  warning, and training refuses: the experiment would build the state
  afresh in its first step and train from fresh weights at the saved step.
  """
  if isinstance(live, _FlatLeaves):
    return list(leaves)
  if entry["skeleton"] and "iterator" in entry["skeleton"] and live is None and training:
    raise CheckpointRefused(
        f"checkpoint entry {name} holds a data iterator's position, but the experiment holds "
        "None there: build the iterator in __init__ so that training resumes where it was")
  live_treedef = None if live is None else jax.tree.structure(live)
  not_rebuilt = None
  try:
    value = None if entry["skeleton"] is None else _rebuild(entry["skeleton"], leaves)
  except _NotRebuilt as e:
    value, not_rebuilt = None, e.args[0]
  if value is not None or entry["skeleton"] == {"none": True}:
    # Same leaves, other node types (a class the skeleton cannot name): take the live ones.
    if live_treedef is not None and live_treedef.num_leaves == len(leaves) and \
        live_treedef != jax.tree.structure(value):
      value = jax.tree.unflatten(live_treedef, _in_live_order(entry, leaves, live, name))
    elif value is not None and live_treedef is not None and \
        not jax.tree_util.treedef_is_leaf(live_treedef):
      # State that grows (a list appended to, a dict filled later) holds more
      # than `__init__` built, never less: arrays only the live value has
      # are a changed model's, which the saved value would leave unset.
      saved = set(_named_leaves(name, value))
      new = sorted(leaf_name for leaf_name, leaf in _named_leaves(name, live).items()
                   if leaf_name not in saved
                   and (isinstance(leaf, jax.ShapeDtypeStruct) or _is_array(leaf)))
      if new:
        raise _DoesNotFit(f"entry {name} lacks {_some(new)}, which the experiment's has")
      if training:  # An evaluation restores what it finds, as jaxline's did.
        value = _without_extras(name, value, live, drop_extra)
    return value
  if live_treedef is not None and live_treedef.num_leaves == len(leaves):
    return jax.tree.unflatten(live_treedef, _in_live_order(entry, leaves, live, name))
  if live is None and name.startswith(_MODULE_PREFIX):
    if training:
      why = (f"its {not_rebuilt}" if not_rebuilt else
             "its type is not a dict, list, tuple, NamedTuple or pytree dataclass")
      raise CheckpointRefused(
          f"checkpoint entry {name} cannot be restored: the experiment holds None there and "
          f"{why}; create it in __init__ so that training resumes it rather than starting it "
          "afresh")
    logging.warning("[jaxline_ng] Checkpoint entry %s is not restored: the experiment holds "
                    "None there (build it in __init__ to restore it).", name)
    return None
  raise _DoesNotFit(
      f"entry {name} has {len(leaves)} values but the experiment's has "
      f"{None if live_treedef is None else live_treedef.num_leaves}")


def _read_arrays(path: str, live_nest: dict[str, Any], training: bool, drop_extra: bool):
  """`_load` up to the checksums: what every process does on its own."""
  meta = _read_meta(path)
  # A renamed step directory would be resumed at its step, and orbax would
  # later refuse to save below the step its name claims. (`_load` checks the
  # saved global_step against meta's step.)
  name = os.path.basename(os.path.normpath(path))
  if name.isdigit() and int(name) != meta["step"]:
    raise UnusableCheckpoint(f"it holds step {meta['step']}, but its directory is named {name}")
  # Without the same x64 setting its 64-bit arrays would not read back as they were written.
  saved_x64 = meta["topology"].get("x64", jax.config.jax_enable_x64)
  if saved_x64 != jax.config.jax_enable_x64:
    raise _DoesNotFit(f"it was saved with jax_enable_x64={saved_x64}, and this run has "
                      f"{jax.config.jax_enable_x64}")
  live = _named_entries(live_nest)
  wants_module = "experiment_module" in live_nest
  entries = meta["entries"]
  unlisted = set()  # Entries the live state does not list: not read.
  for name in entries:
    if name.startswith(_MODULE_PREFIX):
      if wants_module and name not in live:
        if training and drop_extra:
          logging.warning("[jaxline_ng] Not restored (config.%s): %s, which the experiment "
                          "does not checkpoint.", DROP_EXTRA_KEY, name)
        if not training or drop_extra:  # As jaxline: e.g. no optimizer in eval.
          unlisted.add(name)
          continue
        raise _DoesNotFit(f"it holds experiment_module/{name[len(_MODULE_PREFIX):]}, "
                          "which the experiment does not checkpoint (config."
                          f"{DROP_EXTRA_KEY}=True resumes without it)")
    elif name not in _STATE_ATTRS and name not in live:
      # As jaxline, which restores the live state's entries only: one that
      # `on_new_best_model` added to the best state is not a damage.
      unlisted.add(name)
  if wants_module:
    missing = sorted(name for name in live if name.startswith(_MODULE_PREFIX)
                     and name not in entries)
    if missing:
      raise _DoesNotFit(f"it lacks {', '.join(missing)}, which the experiment checkpoints")

  def wanted(name):
    return name not in unlisted and (wants_module or not name.startswith(_MODULE_PREFIX))

  # The orbax tree to restore: one target per array of the entries wanted.
  targets: dict[str, Any] = {}
  restore_args: dict[str, Any] = {}
  expected = []  # (tree path, saved description)
  other_dtypes = []  # Arrays restored with another dtype than the live one.
  for name, entry in entries.items():
    if not wanted(name):
      continue
    live_leaves = {} if name == "train_step_rng" else _named_leaves(name, live.get(name))
    for leaf in entry["leaves"]:
      if "array" not in leaf:
        continue
      tree_path = leaf["array"]
      live_leaf = live_leaves.get("/".join(tree_path))
      saved = meta["arrays"]["/".join(tree_path)]
      shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])
      # The model's arrays (`_live_layout` gives them as shapes) keep the
      # shapes `__init__` gives them; their dtype may drift as they train
      # (bfloat16 weights scaled by a float32), so it is the saved one, as
      # jaxline restored. Other arrays are restored as saved, as jaxline's
      # setattr did (a NON_BROADCAST buffer that grows): onto their live
      # devices where the saved shape fits them, else on the host.
      if name == "train_step_rng" and live.get(name) is not None and \
          shape[-1:] != np.shape(live[name])[-1:]:
        raise _DoesNotFit(
            f"train_step_rng holds keys of {(shape or (0,))[-1]} words where this run's hold "
            f"{np.shape(live[name])[-1]} (another PRNG implementation: jax_default_prng_impl)")
      pmap_mode = mesh_lib.active_mesh() is None
      if (isinstance(live_leaf, jax.ShapeDtypeStruct) and tuple(live_leaf.shape) != shape) or (
          isinstance(live_leaf, jax.Array) and _per_device_elsewhere(live_leaf, shape, meta)):
        saved_by, now = _describe_topology(meta["topology"]), _describe_topology(_topology())
        raise _DoesNotFit(
            f"{'/'.join(tree_path)} has shape {shape} but the experiment's __init__ makes it "
            f"{tuple(live_leaf.shape)}"
            + (f" (saved by {saved_by}, now {now})" if saved_by != now else ""))
      live_dtype = getattr(live_leaf, "dtype", None)
      if live_dtype is not None and not jax.dtypes.issubdtype(live_dtype, jax.dtypes.extended) \
          and np.dtype(live_dtype) != dtype:
        other_dtypes.append(f"{'/'.join(tree_path)} {dtype} (__init__ makes {live_dtype})")
      if isinstance(live_leaf, jax.Array) and not devices.holds_shape(
          live_leaf, shape, pmap_layout=pmap_mode):
        live_leaf = None
      sharding = getattr(live_leaf, "sharding", None)
      if sharding is not None and not pmap_mode and len(sharding.device_set) > 1:
        arg = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
        target = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      else:
        arg = ocp.RestoreArgs(restore_type=np.ndarray)
        target = np.zeros((), dtype)  # Only its place in the tree matters.
      node_t, node_a = targets, restore_args
      for part in tree_path[:-1]:
        node_t, node_a = node_t.setdefault(part, {}), node_a.setdefault(part, {})
      node_t[tree_path[-1]], node_a[tree_path[-1]] = target, arg
      expected.append((tree_path, shape, dtype, saved["fingerprint"]))

  if other_dtypes:
    # Not refused: a dtype may drift as the state trains. But a model changed
    # to another precision would go on in the old one without a word.
    logging.warning("[jaxline_ng] Restored %d arrays in the dtype they were saved in: %s%s.",
                    len(other_dtypes), "; ".join(other_dtypes[:3]),
                    " and more" if len(other_dtypes) > 3 else "")
  restored: dict[str, Any] = {}
  if targets:
    try:
      restored = _reader().restore(
          os.path.abspath(path), args=ocp.args.Composite(**{_STATE_ITEM: ocp.args.PyTreeRestore(
              item=targets, restore_args=restore_args, partial_restore=True)}))[_STATE_ITEM]
    except Exception as e:  # pylint: disable=broad-except  (any damage makes it unusable)
      raise UnusableCheckpoint(f"its arrays do not load ({_one_line_reason(e)})") from None

  def at(tree_path):
    node = restored
    for part in tree_path:
      if not isinstance(node, dict) or part not in node:
        raise UnusableCheckpoint(f"array {'/'.join(tree_path)} is missing")
      node = node[part]
    return node

  return meta, entries, live, wanted, expected, at


# Where TensorStore's and orbax's messages go on to print a whole TensorStore
# spec (~1 kB of JSON over some 60 lines): the reason is what comes before.
_SPEC_MARKERS = (" [tensorstore_spec=", " See full TensorStore details:")


def _one_line_reason(error: BaseException) -> str:
  """`error`'s type and first line without TensorStore's spec, and its cause's
  (orbax's own message names only the array it was reading)."""
  parts = []
  while error is not None and len(parts) < 2:
    text = str(error)
    for marker in _SPEC_MARKERS:
      text = text.split(marker, 1)[0]
    first_line = text.strip().partition("\n")[0]
    parts.append(f"{type(error).__name__}: {first_line}")
    error = error.__cause__
  return "; caused by ".join(parts)


def _raise_agreed(error: Exception | None, agree: bool) -> None:
  """Raises `error`; with `agree`, every process raises what any one found:
  each refuses what one refuses, or falls back where one does."""
  if not agree:
    if error is not None:
      raise error
    return
  # Per process: whether it found damage, and whether a mismatch, so each names the others.
  found = np.zeros((2, jax.process_count()), np.int32)
  found[:, jax.process_index()] = (isinstance(error, UnusableCheckpoint),
                                   isinstance(error, CheckpointRefused))
  damaged, mismatched = (np.flatnonzero(row).tolist() for row in multihost.all_reduce_sum(found))
  if error is not None:
    raise error
  if mismatched:
    raise _DoesNotFit(f"the state of process {', '.join(map(str, mismatched))} does not fit it "
                      "(its log names the difference)")
  if damaged:
    raise UnusableCheckpoint(f"process {', '.join(map(str, damaged))} could not read its part")


def _load(path: str, live_nest: dict[str, Any], agree: bool = False, training: bool = False,
          drop_extra: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads and checks a step directory: `(snapshot, its topology)`.

  Arrays are restored onto the shardings of the live arrays they replace
  where those span several devices of a mesh, else as host arrays; entries
  of the experiment are read only when `live_nest` has an experiment.
  With `agree` (arrays sharded over the processes, each reading its part),
  the processes learn whether every one read its part before verifying the
  checksums: that is a collective, which all must enter or none.
  """
  error = None
  try:
    meta, entries, live, wanted, expected, at = _read_arrays(path, live_nest, training,
                                                             drop_extra)
    values = [at(tree_path) for tree_path, *_ in expected]
  except _DoesNotFit as e:
    error = e
  except CheckpointRefused:
    raise
  except UnusableCheckpoint as e:
    error = e
  except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
    error = UnusableCheckpoint(f"its metadata is malformed ({type(e).__name__}: {e})")
  _raise_agreed(error, agree)
  for (tree_path, shape, dtype, _), value in zip(expected, values):
    if tuple(value.shape) != shape or np.dtype(value.dtype) != dtype:
      raise UnusableCheckpoint(f"array {'/'.join(tree_path)} is {value.dtype}{list(value.shape)} "
                               f"on disk, {dtype}{list(shape)} in its metadata")
  # A checksum of a restored sharded array dispatches a collective: every
  # process restores the same entries, so they dispatch them alike.
  for (tree_path, *_, fingerprint), got in zip(
      expected, _host_fingerprints(dispatch_fingerprints(values))):
    if got != fingerprint:
      raise UnusableCheckpoint(f"array {'/'.join(tree_path)} does not match the checksum "
                               "written with it (damaged after saving)")

  def leaf_value(leaf):
    if "empty" in leaf:
      return np.zeros(leaf["empty"]["shape"], leaf["empty"]["dtype"])
    if "array" not in leaf:
      return leaf["value"]
    if "key_impl" in leaf:
      return jax.random.wrap_key_data(at(leaf["array"]), impl=leaf["key_impl"])
    # Orbax gives a NumPy scalar back as a 0-d array; its mark turns it back.
    return at(leaf["array"])[()] if leaf.get("numpy_scalar") else at(leaf["array"])

  nest: dict[str, Any] = {}
  error = None
  try:
    for name, entry in entries.items():
      if not wanted(name):
        continue
      leaves = [leaf_value(leaf) for leaf in entry["leaves"]]
      value = _value_for(entry, leaves, live.get(name), name, training, drop_extra)
      if name.startswith(_MODULE_PREFIX):
        nest.setdefault("experiment_module", {})[name[len(_MODULE_PREFIX):]] = value
      else:
        nest[name] = value
  except CheckpointRefused as e:  # A process's own state: the others learn of it.
    error = e
  _raise_agreed(error, agree)
  step = nest.get("global_step")
  if not isinstance(step, int) or isinstance(step, bool) or step != meta["step"] or step < 0:
    raise UnusableCheckpoint(f"its global_step {step!r} is not the step {meta['step']!r} "
                             "it was saved at")
  return nest, meta["topology"]


class _FlatLeaves(list):
  """`read`'s stand-in for an entry of classes the reader may not have: the
  entry comes back as the flat list of its leaves."""


def read(checkpoint_dir: str, series: str = "latest",
         step: int | None = None) -> tuple[int, dict[str, Any]]:
  """Reads a checkpoint without an experiment: `(step, snapshot)`, arrays as NumPy.

  For scripts (exporting weights, comparing runs). Entries made of plain
  containers come back as dicts/lists/tuples; others (NamedTuples, optax
  states) as the list of their leaves in tree order. `step` defaults to the
  newest. Checksums are verified.
  """
  series_dir = os.path.join(checkpoint_dir, "checkpoints", series)
  steps = _steps(series_dir)
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {series_dir}")
  step = steps[-1] if step is None else step
  path = os.path.join(series_dir, str(step))
  meta = _read_meta(path)
  live: dict[str, Any] = {"experiment_module": {}}
  for name, entry in meta["entries"].items():
    # Without the experiment's program, an entry of other nodes (NamedTuples
    # included: their classes may not be imported) is a flat list of its leaves.
    skeleton = entry["skeleton"]
    placeholder = (None if skeleton is not None and not _names_classes(skeleton)
                   else _FlatLeaves())
    if name.startswith(_MODULE_PREFIX):
      live["experiment_module"][name[len(_MODULE_PREFIX):]] = placeholder
    else:
      live[name] = placeholder
  nest, _ = _load(path, live)
  return step, nest


def unusable_dir(series_dir: str) -> str:
  """Where unusable checkpoints of a series are moved: beside it, never deleted."""
  return series_dir.rstrip(os.sep) + ".unusable"


def _live_layout(module) -> dict[str, Any]:
  """What `module.snapshot_state()` would hold, without copying. The arrays of
  `CHECKPOINT_ATTRS`, the model, are given as shapes (`jax.ShapeDtypeStruct`):
  one pmap copy's, or a global array's with its sharding."""
  # Deferred: experiment imports this module's users, not the other way round.
  from jaxline_ng import experiment as experiment_lib
  if type(module).snapshot_state is not experiment_lib.AbstractExperiment.snapshot_state:
    return dict(module.snapshot_state())
  attrs, non_broadcast_attrs = experiment_lib.checkpoint_attrs(module)

  def one_copy(leaf):
    if isinstance(leaf, (jax.Array, np.ndarray)):
      return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[0]

  # An attribute the first step creates is absent, not None, until then: jaxline
  # restores by setattr, so experiments written for it may leave it out of __init__.
  # Typed keys are saved as their raw data (`save`), so laid out as it.
  def global_shape(leaf):
    if isinstance(leaf, (jax.Array, np.ndarray)):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None),
                                  weak_type=getattr(leaf, "weak_type", False))
    return leaf

  pmap_mode = mesh_lib.active_mesh() is None
  layout = {name: jax.tree.map(one_copy if pmap_mode else global_shape,
                               devices.raw_keys(getattr(module, attr, None)))
            for attr, name in attrs.items()
            if iterator_state.kind_of(getattr(module, attr, None)) is None}
  layout.update({name: getattr(module, attr) for attr, name in attrs.items() if name not in layout})
  layout.update({name: devices.raw_keys(getattr(module, attr, None))
                 for attr, name in non_broadcast_attrs.items()})
  return layout


class _CheckpointManager(ocp.CheckpointManager):
  """orbax's manager, kept from asking JAX's preemption sync point.

  The sync point counts steps from the calls made to it, and orbax asks it
  about each step it saves, on the save worker, after the loop has moved on:
  a notice arriving then would have this process report a step the loop has
  passed, and the processes could agree on a step it never reaches. The
  loop alone asks (`preemption.StopCheck`) and saves the agreed step itself.
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def _existing_ancestor(path: str) -> str:
  """`path`, or the nearest directory above it that exists."""
  existing = os.path.abspath(path)  # A relative path's dirname ends at "", which never exists.
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  return existing


def _check_writable(path: str) -> None:
  """Raises CheckpointWriteError if saves could not create or write `path`."""
  existing = _existing_ancestor(path)
  if not os.path.isdir(existing):
    raise CheckpointWriteError(errno.ENOTDIR, f"cannot save checkpoints in {path}: {existing} "
                               "is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise CheckpointWriteError(errno.EACCES, f"cannot save checkpoints in {path}: {existing} "
                               "is not writable")


# The longest path a save writes below checkpoint_dir, with room to spare:
# checkpoints/process_<i>/best_<name>/<step>.orbax-checkpoint-tmp-<time>/state/
# ocdbt.process_<i>/d/<32 hex digits> is some 150 characters.
_LONGEST_PATH_BELOW = 200


def check_checkpoint_dir(checkpoint_dir: str) -> None:
  """Raises ConfigError if orbax could not save under `checkpoint_dir`, or read back."""
  existing = _existing_ancestor(checkpoint_dir)
  try:
    path_max = os.pathconf(existing, "PC_PATH_MAX")
  except (OSError, ValueError):  # No limit known here.
    path_max = None
  longest = len(os.fsencode(os.path.abspath(checkpoint_dir))) + _LONGEST_PATH_BELOW
  if path_max is not None and longest >= path_max:
    # Else a whole save interval is trained before the first save fails.
    raise base_config.ConfigError(
        f"config.checkpoint_dir={checkpoint_dir[:40]!r}... is {len(checkpoint_dir)} "
        f"characters long: the checkpoints' paths below it would reach about {longest}, "
        f"beyond this filesystem's limit of {path_max} (PC_PATH_MAX): choose a shorter path")
  if re.search(r"\[.*\]", checkpoint_dir):
    # Orbax gathers the files a save wrote with a glob under the step's
    # directory, which takes "[...]" in the path for a pattern: it would
    # gather nothing, and no array saved there could be read back.
    raise base_config.ConfigError(
        f"config.checkpoint_dir={checkpoint_dir!r}: orbax cannot save under a path holding "
        "'[...]' (it takes it for a glob pattern): choose one without brackets")


class DiskCheckpointer:
  """The Checkpointer protocol over orbax step directories."""

  def __init__(self, config, mode: str):
    check_checkpoint_dir(config.checkpoint_dir)
    logging.get_absl_logger().addFilter(_drop_orbax_info)  # Once: addFilter skips repeats.
    # Train and eval processes share the series; each moves aside only
    # damaged checkpoints of the series it writes.
    self._mode = mode
    self._writes = {"latest"} if mode in ("train", "train_eval_multithreaded") else {"best"}
    if mode == "train_eval_multithreaded":
      self._writes.add("best")
    # Every process restores the chief's checkpoints (a shared filesystem is
    # assumed), so all resume at the same step. In pmap mode, processes that
    # save besides the chief (*_checkpoint_all_hosts) each write to a tree of
    # their own; in mesh mode with several processes, arrays span processes
    # and every process writes its shards into the one tree.
    self._read_root = os.path.join(config.checkpoint_dir, "checkpoints")
    self._root = self._read_root
    self.every_process_saves = config.placement == "mesh" and jax.process_count() > 1
    if not multihost.is_chief() and not self.every_process_saves:
      self._root = os.path.join(self._read_root, f"process_{jax.process_index()}")
    self._max_to_keep = config.max_checkpoints_to_keep
    self._drop_extra = config.get(DROP_EXTRA_KEY, False)  # A config of jaxline's keys lacks it.
    self._restore_path = config.restore_path
    self._live = threading.local()
    self._managers: dict[str, ocp.CheckpointManager] = {}
    self._lock = threading.Lock()
    self._saves = background.Worker("disk_checkpointer")
    # Newer checkpoints the last `restore` tried and could not load: an eval
    # job stops waiting for them once no training run can replace them.
    self.unloadable_newer: list[str] = []
    # The `restore_path` checkpoint a fresh training run started from, if any.
    self.started_from: str | None = None
    for ckpt_series in self._writes:  # Now, not at the first save, minutes of training later.
      _check_writable(self._series_dir(ckpt_series))

  def _dir_name(self, ckpt_series: str) -> str:
    """The directory of `ckpt_series`; an `eval_<name>` job's `best` is `best_<name>`:
    evaluators of several modes run side by side on other data, and one shared
    series would mix their metrics and hand each the other's value to beat."""
    if ckpt_series == "best" and self._mode.startswith("eval_"):
      return "best_" + self._mode[len("eval_"):]
    return ckpt_series

  def _series_dir(self, ckpt_series: str) -> str:
    return os.path.join(self._root, self._dir_name(ckpt_series))

  def _read_series_dir(self, ckpt_series: str) -> str:
    return os.path.join(self._read_root, self._dir_name(ckpt_series))

  def _manager(self, ckpt_series: str) -> ocp.CheckpointManager:
    with self._lock:
      if ckpt_series not in self._managers:
        # Each saving process acts alone (only the chief saves by default),
        # unless every process writes its shards.
        processes = _processes(together=self.every_process_saves)
        # Orbax leaves creating the directory to us (it would wait for every
        # process at a barrier first).
        os.makedirs(self._series_dir(ckpt_series), exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self._max_to_keep,
            enable_async_checkpointing=False,  # Saves run on our own thread already.
            cleanup_tmp_directories=True,
            create=False,
            multiprocessing_options=processes)
        self._managers[ckpt_series] = _CheckpointManager(
            self._series_dir(ckpt_series), options=options)
      return self._managers[ckpt_series]

  def get_experiment_state(self, ckpt_series: str) -> checkpointing.ExperimentState:
    states = self._live.__dict__.setdefault("states", {})
    return states.setdefault(ckpt_series, checkpointing.ExperimentState())

  def save(self, ckpt_series: str, *, validate: Callable[[], None] | None = None) -> None:
    """Snapshots the live state on device now; writes it on a background thread.

    There `validate` runs first (the non-finite guard; if it raises, nothing
    is saved), then orbax writes. The next save and
    `wait_for_checkpointing_to_finish` wait for it. A failed save fails the
    checkpointer for good: every later save and wait raises its error.
    """
    self.wait_for_checkpointing_to_finish()
    state = self.get_experiment_state(ckpt_series)
    manager = self._manager(ckpt_series)
    step = state.global_step
    tree, entries, arrays = encode(checkpointing.device_snapshot(state))
    fingerprints = dispatch_fingerprints([array for _, array in arrays])
    series_dir = self._series_dir(ckpt_series)
    # The chief's training saves hold every process's data positions.
    gathers_positions = (multihost.is_multiprocess() and multihost.is_chief()
                         and ckpt_series == "latest" and ckpt_series in self._writes)
    # In pmap mode orbax is handed host copies: it records a device array's
    # sharding, and the per-device key chain's would let orbax alone read the
    # checkpoint only on as many devices. (A process of a multi-process run
    # that saves alone must hand over its own arrays so anyway.) Mesh-mode
    # global arrays go as they are: each process writes its shards. An array
    # on one device is this process's own (a NON_BROADCAST value): orbax
    # refuses such a "host local" array when several processes save.
    on_host = mesh_lib.active_mesh() is None
    if not on_host:
      tree = jax.tree.map(lambda x: jax.device_get(x) if isinstance(x, jax.Array) and len(
          x.sharding.device_set) == 1 and len(jax.devices()) > 1 else x, tree)

    def write():
      if validate is not None:
        try:
          validate()
        except Exception:  # pylint: disable=broad-except  (the guard reports its own failure)
          logging.warning("[jaxline_ng] Not saving %s/%d: the checks before saving it failed "
                          "(see above).",
                          ckpt_series, step)
          return
      latest = manager.latest_step()
      if latest == step:  # Saved already (a final save right after a periodic one).
        if ckpt_series != "latest":  # A best step an earlier evaluator saved (another metric's).
          logging.warning("[jaxline_ng] %s/%d is saved already: kept as it is.", ckpt_series, step)
        return
      saved_entries = entries
      if gathers_positions:
        saved_entries = _with_peer_positions(entries, step)
      meta = {"format": FORMAT, "step": step, "topology": _topology(), "entries": saved_entries,
              "arrays": {"/".join(path): {"shape": list(np.shape(array)),
                                          "dtype": np.dtype(array.dtype).name,
                                          "fingerprint": fingerprint}
                         for (path, array), fingerprint in zip(
                             arrays, _host_fingerprints(fingerprints))}}
      meta["digest"] = _digest(meta)
      items = {_META_ITEM: ocp.args.JsonSave(meta)}
      if tree:
        items[_STATE_ITEM] = ocp.args.StandardSave(jax.device_get(tree) if on_host else tree)
      self._unlink_links_rotated_out(series_dir, step)
      try:
        saved = manager.save(step, args=ocp.args.Composite(**items))
        manager.wait_until_finished()
      except (OSError, ValueError) as e:
        code = _os_error_code(e)
        if code is None and not isinstance(e, OSError):
          raise  # Not the filesystem: a bug to see whole.
        reason = os.strerror(code) if code else e
        raise CheckpointWriteError(code, f"cannot save step {step} in {series_dir}: "
                                   f"{reason}") from e
      if not saved:
        raise RuntimeError(f"orbax did not save step {step} in {series_dir} (it holds step "
                           f"{latest}): move the newer step directories away to save there")
      logging.info("[jaxline_ng] Saved checkpoint %s/%d to %s.", ckpt_series, step, series_dir)

    self._saves.submit(write)

  def _unlink_links_rotated_out(self, series_dir: str, step: int) -> None:
    """Removes the symbolic links among the step directories that saving `step`
    rotates out: the link, never its target, which orbax would delete through
    or fail on (after saving, reporting the save failed)."""
    if not (multihost.is_chief() or not self.every_process_saves):
      return  # The chief rotates the one tree every process writes to.
    for old_step in sorted({*_steps(series_dir), step})[:-self._max_to_keep]:
      path = os.path.join(series_dir, str(old_step))
      if os.path.islink(path):
        target = os.readlink(path)
        os.unlink(path)
        logging.warning("[jaxline_ng] Rotated out step %d: removed the symbolic link %s (its "
                        "target %s is kept).", old_step, path, target)

  def _candidates(self, ckpt_series: str) -> list[str]:
    """Step directories to restore from, newest first; `restore_path` for a fresh `latest`."""
    series_dir = self._read_series_dir(ckpt_series)
    paths = [os.path.join(series_dir, str(step)) for step in reversed(_steps(series_dir))]
    if not paths and ckpt_series == "latest" and self._restore_path:
      # Another run's series, or its checkpoint_dir; else a step directory.
      for series_dir in (self._restore_path,
                         os.path.join(self._restore_path, "checkpoints", "latest")):
        steps = _steps(series_dir)
        if steps:  # All of them: a damaged one is reported and the one before it used.
          return [os.path.join(series_dir, str(step)) for step in reversed(steps)]
      paths = [self._restore_path]
    return paths

  def can_be_restored(self, ckpt_series: str) -> bool:
    return bool(self._candidates(ckpt_series))

  def restore_path(self, ckpt_series: str) -> str | None:
    candidates = self._candidates(ckpt_series)
    return candidates[0] if candidates else None

  def restore(self, ckpt_series: str, path: str | None = None) -> None:
    """Loads the newest usable checkpoint of `ckpt_series`, or the one at `path`.

    Newer ones that fail are reported and, by the process that writes the
    series, moved aside once an older one has loaded. Raises
    CheckpointRefused when none can be used.

    Args:
      ckpt_series: the series, e.g. "latest".
      path: a step directory `restore_path` returned: the processes of a
        multi-process evaluation restore the one the chief chose, even when
        a newer one has landed since, and no other (the older ones each
        lists can differ while another job rotates them out).
    """
    candidates = [path] if path is not None else self._candidates(ckpt_series)
    state = self.get_experiment_state(ckpt_series)
    fresh_run = not _steps(self._read_series_dir(ckpt_series))
    live = devices.raw_keys(checkpointing.snapshotted_items(state))
    if getattr(state, "experiment_module", None) is not None:
      live["experiment_module"] = _live_layout(state.experiment_module)
    # The experiment's own mode where it keeps one (kfac-jax's does, and
    # checkpoints fewer attributes in eval): an evaluator may share the
    # trainer's checkpointer. Else this checkpointer's mode.
    training = getattr(getattr(state, "experiment_module", None), "mode", self._mode) == "train"
    failures = []
    for position, candidate in enumerate(candidates):
      try:
        nest, topology = _load(candidate, live, agree=self.every_process_saves,
                               training=training, drop_extra=self._drop_extra)
      except _DoesNotFit as e:
        seeding = fresh_run and ckpt_series == "latest" and self._restore_path
        where = f"config.restore_path={self._restore_path!r}: " if seeding else ""
        hint = ", or a new checkpoint_dir" if training and not seeding else ""
        raise CheckpointRefused(
            f"{where}checkpoint {candidate} does not fit the experiment: {e} (if its code "
            f"has changed since, use the code that saved it{hint})") from None
      except CheckpointRefused:
        raise
      except (UnusableCheckpoint, KeyError, TypeError, IndexError, AttributeError) as e:
        logging.warning("[jaxline_ng] Checkpoint %s could not be loaded: %s%s", candidate, e,
                        "; trying the previous one." if position + 1 < len(candidates) else ".")
        failures.append((candidate, e))
        continue
      if nest["global_step"] > rng.MAX_STEP:
        raise CheckpointRefused(
            f"checkpoint {candidate} is at step {nest['global_step']}, beyond {rng.MAX_STEP}, "
            "the most steps a step's int32 global_step counts (as in jaxline)")
      starting = fresh_run and ckpt_series == "latest"
      if starting:
        # `restore_path` starts a new run where the other run's checkpoint is:
        # its step, key chain and experiment state, so the new run continues
        # it exactly (an optimizer's own step count and the schedules read
        # from it agree with the step). Its config and saving clock are the
        # other run's: an eval job would take that run's end for this one's.
        nest = {name: value for name, value in nest.items()
                if name not in ("run_config", "periodic_action_times")}
        if training:
          self.started_from = candidate
      if training:  # An evaluation takes no key from the chain.
        _warn_if_another_topology(topology, nest["global_step"])
        if not starting and ckpt_series == "latest" and self._restore_path:
          # It starts new runs only: a requeued run keeps it on its command line.
          logging.warning("[jaxline_ng] config.restore_path=%r is not read: the run resumes its "
                          "own checkpoint %s.", self._restore_path, candidate)
      if not fresh_run:
        self._move_aside([p for p, _ in failures], ckpt_series)
      self.unloadable_newer = [p for p, _ in failures]
      checkpointing.restore_snapshot(state, nest)
      if starting and training:
        logging.info("[jaxline_ng] Started from config.restore_path's checkpoint %s (step %d); "
                     "this run saves to %s.", candidate, state.global_step,
                     self._series_dir(ckpt_series))
      else:
        logging.info("[jaxline_ng] Restored checkpoint %s.", candidate)
      return
    if not failures:
      raise CheckpointRefused(f"no checkpoint for series {ckpt_series!r} in {self._read_root}")
    # A reader of a series another job writes may have lost a race with that
    # job's rotation of old checkpoints: alone, or as one of the processes of
    # an evaluation trying the chief's choice (they agree on going on).
    if ckpt_series not in self._writes and (path is not None or not multihost.is_multiprocess()):
      newest_failed = os.path.basename(failures[0][0])
      steps_now = _steps(self._read_series_dir(ckpt_series))
      if newest_failed.isdigit() and steps_now and steps_now[-1] > int(newest_failed):
        raise checkpointing.CheckpointSuperseded(
            f"{failures[0][0]} did not load ({failures[0][1]}) and step {steps_now[-1]} has "
            "been saved since, rotating older ones out")
    if fresh_run and ckpt_series == "latest" and self._restore_path:
      raise CheckpointRefused(f"config.restore_path={self._restore_path!r}: {failures[0][1]}")
    raise CheckpointRefused(
        f"no usable checkpoint for series {ckpt_series!r}: {failures[0][0]}: {failures[0][1]}"
        + (f" (and {len(failures) - 1} older ones)" if len(failures) > 1 else ""))

  def _move_aside(self, paths: list[str], ckpt_series: str) -> None:
    """Moves unusable step directories out of the series, so saves go past their steps."""
    if ckpt_series not in self._writes or not multihost.is_chief():
      return
    for path in paths:
      target_dir = unusable_dir(os.path.dirname(path))
      os.makedirs(target_dir, exist_ok=True)
      moved_at = time.strftime("%Y%m%dT%H%M%S")
      target = os.path.join(target_dir, f"{os.path.basename(path)}-{moved_at}")
      os.rename(path, target)
      logging.warning("[jaxline_ng] Moved the unusable checkpoint %s to %s (kept for "
                      "inspection; saving continues past its step).", path, target)

  def set_aside(self, ckpt_series: str) -> None:
    """Moves the series this process writes aside, kept beside it.

    Where every process writes into one series (mesh mode), the chief moves
    it and the others wait for that, before any of them saves there again.
    """
    series_dir = self._series_dir(ckpt_series)  # The chief's, or a process's own tree.
    if (multihost.is_chief() or not self.every_process_saves) and os.path.isdir(series_dir):
      target = f"{series_dir.rstrip(os.sep)}.earlier-{time.strftime('%Y%m%dT%H%M%S')}"
      os.rename(series_dir, target)
      logging.warning("[jaxline_ng] Moved %s to %s.", series_dir, target)
    if self.every_process_saves:
      multihost.rendezvous(f"jaxline_ng_set_aside_{ckpt_series}")
    with self._lock:
      self._managers.pop(ckpt_series, None)

  def wait_for_checkpointing_to_finish(self) -> None:
    self._saves.wait()
