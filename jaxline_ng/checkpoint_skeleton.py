"""The skeleton of a checkpoint entry: a JSON description of its containers.

With the entry's leaves it rebuilds the value without the live experiment
holding one to copy the structure from (state made in the first step).
"""

import collections
import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxline_ng import iterator_state

PLAIN_VALUES = (bool, int, float, str)


def skeleton_of(value: Any) -> Any:
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
    if isinstance(node, (jax.Array, np.ndarray, np.generic, *PLAIN_VALUES)):
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


class NotRebuilt(LookupError):
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
    raise NotRebuilt(f"{kind} {name} is not imported (or has other fields)")
  return cls


def _constructed(described: str, source: str, construct: Callable[[], Any],
                 flattens_as_saved: Callable[[Any], bool], otherwise: str) -> Any:
  """`construct()`, the experiment's class built from restored values, if JAX
  still flattens it as it did when saved; raises NotRebuilt saying why not."""
  try:
    value = construct()
  except (TypeError, ValueError) as e:  # A constructor of its own, a __post_init__ check.
    raise NotRebuilt(f"{described} does not rebuild from {source} "
                      f"({type(e).__name__}: {e})") from None
  if not flattens_as_saved(value):
    raise NotRebuilt(f"{described} is not imported (or {otherwise})")
  return value


def rebuild(skeleton: Any, leaves: list) -> Any:
  """The value `skeleton` describes, with `leaves`; raises NotRebuilt."""
  if "namedtuple" in skeleton:
    cls = _imported_class("NamedTuple class", skeleton["namedtuple"], lambda cls: issubclass(
        cls, tuple) and len(getattr(cls, "_fields", ())) == len(skeleton["fields"]))
    return cls(*(rebuild(v, leaves) for v in skeleton["fields"]))
  if "dataclass" in skeleton:
    names = [name for name, _ in skeleton["fields"]]
    cls = _imported_class("dataclass", skeleton["dataclass"],
                          lambda cls: dataclasses.is_dataclass(cls)
                          and sorted(_init_fields(cls)) == sorted(names))
    # Field by field by name: the class may declare them in another order now.
    return _constructed(
        f"dataclass {skeleton['dataclass']}", "its fields",
        lambda: cls(**{name: rebuild(v, leaves) for name, v in skeleton["fields"]}),
        lambda value: _pytree_dataclass_fields(value) is not None, "has other fields")
  if "mapping" in skeleton:
    cls = _imported_class("Mapping class", skeleton["mapping"],
                          lambda cls: issubclass(cls, Mapping))
    return _constructed(
        f"Mapping class {skeleton['mapping']}", "a dict",
        lambda: cls({key: rebuild(v, leaves) for key, v in skeleton["dict"].items()}),
        _flattens_as_a_dict, "flattens otherwise")
  if "none" in skeleton:
    return None
  if "iterator" in skeleton:
    return iterator_state.Position.from_json(leaves[0])
  if "leaf" in skeleton:
    return leaves[skeleton["leaf"]]
  if "dict" in skeleton:
    return {k: rebuild(v, leaves) for k, v in skeleton["dict"].items()}
  if "ordered_dict" in skeleton:
    return collections.OrderedDict((k, rebuild(v, leaves)) for k, v in skeleton["ordered_dict"])
  if "list" in skeleton:
    return [rebuild(v, leaves) for v in skeleton["list"]]
  return tuple(rebuild(v, leaves) for v in skeleton["tuple"])


def names_classes(skeleton: Any) -> bool:
  """Whether `skeleton` names a class, which only the experiment's program has."""
  if "namedtuple" in skeleton or "dataclass" in skeleton or "mapping" in skeleton:
    return True
  children = (skeleton.get("list") or skeleton.get("tuple") or skeleton.get("dict", {}).values()
              or [child for _, child in skeleton.get("ordered_dict", ())])
  return any(names_classes(child) for child in children)
