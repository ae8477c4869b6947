"""Fitting a saved checkpoint entry to the live experiment's value.

A sound checkpoint may still not fit the experiment: code changed since,
another topology, state the experiment builds in its first step. Here each
entry's saved value is matched to the live one by name, and refused
(`checkpoint_format.DoesNotFit`) where training would silently go on with
other weights than it saved.
"""

import collections
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxline_ng import checkpoint_format, devices, iterator_state
from jaxline_ng import experiment as experiment_lib
from jaxline_ng import mesh as mesh_lib
from jaxline_ng.checkpoint_format import (
  DROP_EXTRA_KEY,
  MODULE_PREFIX,
  CheckpointRefused,
  DoesNotFit,
  is_array,
  named_leaves,
  orbax_path,
)
from jaxline_ng.checkpoint_skeleton import NotRebuilt, rebuild


def _in_live_order(entry: dict[str, Any], leaves: list, live: Any, name: str) -> list:
  """An entry's `leaves` in the order of the live value's, matched by name.

  A key or field renamed since the save would otherwise hand its arrays to
  whichever leaf now sorts in its place (two layers of one shape would swap
  weights): names that differ do not fit. Fields reordered are matched up.
  """
  saved = ["/".join(leaf["array"]) if "array" in leaf else None for leaf in entry["leaves"]]
  live_names = list(named_leaves(name, live))
  if all(saved_name in (None, live_name) for saved_name, live_name in zip(saved, live_names)):
    return leaves
  if None not in saved and sorted(saved) == sorted(live_names):
    position = {saved_name: i for i, saved_name in enumerate(saved)}
    return [leaves[position[live_name]] for live_name in live_names]
  gone = sorted(set(saved) - set(live_names) - {None})
  new = sorted(set(live_names) - set(saved))
  raise DoesNotFit(f"entry {name} holds {', '.join(gone) or 'other values'} where the "
                    f"experiment's has {', '.join(new) or 'other values'}")


def _some(names: list[str]) -> str:
  """Up to three of `names`, and how many more."""
  more = f" and {len(names) - 3} more" if len(names) > 3 else ""
  return ", ".join(names[:3]) + more


def per_device_elsewhere(live_leaf: jax.Array, shape: tuple[int, ...],
                          meta: dict[str, Any]) -> bool:
  """Whether `live_leaf` holds a row per local device (pmap) and the saved
  value one per device of another count: it cannot run on this topology.

  A row per device is the pmap layout, or, on one device, a leading axis
  as long as the device count here where the saved one was as long as the
  saving run's (`jnp.zeros((jax.local_device_count(),))` in `__init__`).
  """
  saved_devices = meta["topology"].get("local_device_count")
  if (not mesh_lib.placement().per_device or shape[:1] != (saved_devices,)
      or live_leaf.shape[:1] in ((), (saved_devices,))):
    return False
  return 0 in devices.split_axes(live_leaf) or (
      live_leaf.shape[0] == checkpoint_format.current_topology()["local_device_count"]
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
  live_leaves = named_leaves(name, live)
  saved = {"/".join(orbax_path(name, path)): (path, leaf)
           for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]}
  extra = [leaf_name for leaf_name, (path, _) in saved.items()
           if leaf_name not in live_leaves and not _grew_into(live, path)]
  if not extra:
    return value
  if not drop_extra:
    raise DoesNotFit(f"entry {name} holds {_some(extra)}, which the experiment's does not "
                      f"have (config.{DROP_EXTRA_KEY}=True resumes without them)")
  logging.warning("[jaxline_ng] Not restored (config.%s): %s, which the experiment's %s does "
                  "not have.", DROP_EXTRA_KEY, _some(extra), name)
  return jax.tree.unflatten(jax.tree.structure(live), [
      saved[leaf_name][1] if leaf_name in saved else leaf
      for leaf_name, leaf in live_leaves.items()])


def value_for(entry: dict[str, Any], leaves: list, live: Any, name: str,
               training: bool, drop_extra: bool = False) -> Any:
  """An entry's value: rebuilt from its skeleton, else in the live value's structure.

  An entry the experiment holds as None is restored when its skeleton
  rebuilds it, as jaxline restores every checkpointed attribute. When it
  cannot be (a type other than containers and imported classes), an
  evaluation mode keeps None (an optimizer state it does not use) with a
  warning, and training refuses: the experiment would build the state
  afresh in its first step and train from fresh weights at the saved step.
  """
  if isinstance(live, FlatLeaves):
    return list(leaves)
  if entry["skeleton"] and "iterator" in entry["skeleton"] and live is None and training:
    raise CheckpointRefused(
        f"checkpoint entry {name} holds a data iterator's position, but the experiment holds "
        "None there: build the iterator in __init__ so that training resumes where it was")
  live_treedef = None if live is None else jax.tree.structure(live)
  not_rebuilt = None
  try:
    value = None if entry["skeleton"] is None else rebuild(entry["skeleton"], leaves)
  except NotRebuilt as e:
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
      saved = set(named_leaves(name, value))
      new = sorted(leaf_name for leaf_name, leaf in named_leaves(name, live).items()
                   if leaf_name not in saved
                   and (isinstance(leaf, jax.ShapeDtypeStruct) or is_array(leaf)))
      if new:
        raise DoesNotFit(f"entry {name} lacks {_some(new)}, which the experiment's has")
      if training:  # An evaluation restores what it finds, as jaxline's did.
        value = _without_extras(name, value, live, drop_extra)
    return value
  if live_treedef is not None and live_treedef.num_leaves == len(leaves):
    return jax.tree.unflatten(live_treedef, _in_live_order(entry, leaves, live, name))
  if live is None and name.startswith(MODULE_PREFIX):
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
  raise DoesNotFit(
      f"entry {name} has {len(leaves)} values but the experiment's has "
      f"{None if live_treedef is None else live_treedef.num_leaves}")


class FlatLeaves(list):
  """`read`'s stand-in for an entry of classes the reader may not have: the
  entry comes back as the flat list of its leaves."""


def live_layout(module) -> dict[str, Any]:
  """What `module.snapshot_state()` would hold, without copying. The arrays of
  `CHECKPOINT_ATTRS`, the model, are given as shapes (`jax.ShapeDtypeStruct`):
  one pmap copy's, or a global array's with its sharding."""
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

  per_device = mesh_lib.placement().per_device
  layout = {name: jax.tree.map(one_copy if per_device else global_shape,
                               devices.raw_keys(getattr(module, attr, None)))
            for attr, name in attrs.items()
            if iterator_state.kind_of(getattr(module, attr, None)) is None}
  layout.update({name: getattr(module, attr) for attr, name in attrs.items() if name not in layout})
  layout.update({name: devices.raw_keys(getattr(module, attr, None))
                 for attr, name in non_broadcast_attrs.items()})
  return layout
