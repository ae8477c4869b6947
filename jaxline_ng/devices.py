"""Placing pmap-replicated state on the local devices and reading it back.

Indexing a pmap output (`x[0]`) gathers every shard to one device; the
functions here read the first device's shard instead.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxline_ng import debugging

# pmap's compile cache is keyed on its inputs' mesh, axis names included: with
# "i", the name jaxline experiments pass to pmap, the step compiles once, not twice.
DEVICE_AXIS = "i"


@functools.cache
def per_device_sharding() -> NamedSharding:
  """Shards axis 0 of an array over the local devices: pmap's input layout."""
  return NamedSharding(Mesh(np.array(jax.local_devices()), (DEVICE_AXIS,)),
                       PartitionSpec(DEVICE_AXIS))


def put_per_device(tree: Any) -> Any:
  """Places arrays whose leading axis is the local device count, one row per device."""
  return jax.device_put(tree, per_device_sharding())


def is_typed_key(value: Any) -> bool:
  """Whether `value` is an array of typed PRNG keys (`jax.random.key`, or
  `jax.random.PRNGKey` with `jax_enable_custom_prng`), which NumPy cannot hold."""
  return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def bcast_local_devices(value: Any) -> Any:
  """Replicates a pytree onto every local device, adding a leading device axis.

  The result is what `jax.pmap` takes as a replicated argument and what the
  `CHECKPOINT_ATTRS` of an experiment hold.
  """
  num_devices = jax.local_device_count()

  def broadcast(leaf):
    if is_typed_key(leaf):
      return jnp.broadcast_to(leaf, (num_devices,) + leaf.shape)
    host_value = np.asarray(jax.device_get(leaf))
    return np.broadcast_to(host_value, (num_devices,) + host_value.shape)

  return put_per_device(jax.tree.map(broadcast, value))


@debugging.compiled
def _drop_leading_axis(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _placement(leaf: jax.Array) -> tuple[int | None, bool]:
  """`(position, one_copy)`: the position of the shard of `leaf` that holds
  `leaf[0]` whole (the whole value if replicated), or None when none does (an
  array split along a later axis, such as a mesh's `model` axis); and whether
  one shard is one whole copy: the value of a replicated array, or the first
  row of a per-device one."""
  position = next(
      (position for position, shard in enumerate(leaf.addressable_shards)
       if all(index.start in (None, 0) and (axis == 0 or index.stop in (None, size))
              for axis, (index, size) in enumerate(zip(shard.index, leaf.shape)))),
      None)
  one_copy = leaf.is_fully_replicated or (
      bool(leaf.shape) and leaf.shape[0] == len(leaf.sharding.addressable_devices)
      and leaf.sharding.shard_shape(leaf.shape)[0] == 1 and position is not None)
  return position, one_copy


def first_copy_to_host(tree: Any) -> Any:
  """`tree` on the host, each replicated or per-device array read from the
  first local device only (a per-device array keeps a leading axis of 1).

  Nothing is dispatched, so no collective: any thread may call it. This is
  where the loop's logging, guard and save checks wait for the devices.
  """

  def read(leaf):
    if not isinstance(leaf, jax.Array):
      return leaf
    if len(leaf.sharding.addressable_devices) > 1:
      position, one_copy = _placement(leaf)
      if one_copy:
        return np.asarray(leaf.addressable_data(position))
    return np.asarray(leaf)

  return jax.tree.map(read, tree)


def get_first(xs: Any) -> Any:
  """Returns the first device's copy of a pmap-replicated pytree.

  Nothing is gathered across devices, and the result holds fresh buffers that
  donating the input does not invalidate. Non-JAX leaves are indexed as jaxline did.
  """
  leaves, treedef = jax.tree.flatten(xs)
  # One dispatch per device set (a jit takes arrays of one).
  by_device: dict[Any, list[tuple[int, jax.Array]]] = {}
  for i, leaf in enumerate(leaves):
    if np.ndim(leaf) == 0:
      # Mesh mode's global_step is a scalar (a NumPy one): code written for
      # pmap that reads it so would fail on "invalid index to scalar variable".
      kind = getattr(leaf, "dtype", type(leaf).__name__)
      raise ValueError(
          f"get_first: a 0-d {kind} value has no device axis to take the first of (in mesh "
          "mode global_step and global arrays have none: use the value itself, or run code "
          "written for pmap with config.placement='pmap')")
    if isinstance(leaf, jax.Array):
      # The buffer holding the first row whole, if one does.
      position = _placement(leaf)[0] if len(leaf.sharding.addressable_devices) > 1 else None
      shard = leaf if position is None else leaf.addressable_data(position)
      by_device.setdefault(frozenset(shard.sharding.device_set), []).append((i, shard))
  for group in by_device.values():
    firsts = _drop_leading_axis([shard for _, shard in group])
    for (position, _), first in zip(group, firsts):
      leaves[position] = first
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, jax.Array):
      leaves[i] = leaf[0]
  return jax.tree.unflatten(treedef, leaves)


@debugging.compiled
def _copy_on_device(arrays):
  return [jnp.copy(x) for x in arrays]


def fresh_copies(tree: Any) -> Any:
  """`tree` with every `jax.Array` copied to new buffers on its devices (not
  waited for), which donating or deleting the originals does not touch."""
  leaves, treedef = jax.tree.flatten(tree)
  by_sharding: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.Array):
      by_sharding.setdefault(leaf.sharding, []).append(i)
  for positions in by_sharding.values():
    for i, copy in zip(positions, _copy_on_device([leaves[i] for i in positions])):
      leaves[i] = copy
  return jax.tree.unflatten(treedef, leaves)


def maybe_device_get(x: Any) -> Any:
  """`jax.device_get(x)` for a JAX array, `x` itself otherwise (jaxline's helper)."""
  return jax.device_get(x) if isinstance(x, jax.Array) else x


def placed_from_host(value: Any, place) -> Any:
  """`place(value copied to the host)`: an array on one device cannot be put
  on the devices of other processes. Typed keys, which NumPy cannot hold, go
  as their raw data and are made typed again."""
  if is_typed_key(value):
    return jax.random.wrap_key_data(placed_from_host(jax.random.key_data(value), place),
                                    impl=jax.random.key_impl(value))
  return place(np.asarray(jax.device_get(value)))


def raw_keys(tree: Any) -> Any:
  """`tree` with each array of typed PRNG keys replaced by its raw `uint32` data."""
  return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_typed_key(leaf) else leaf,
                      tree)


def split_axes(array: jax.Array) -> tuple[int, ...]:
  """The axes of `array` its sharding splits over devices. A `NamedSharding`
  names them in its spec, even over one device, as pmap's outputs do."""
  sharding = array.sharding
  if isinstance(sharding, NamedSharding):
    return tuple(axis for axis, part in enumerate(sharding.spec) if part not in (None, ()))
  return tuple(axis for axis, (piece, whole)
               in enumerate(zip(sharding.shard_shape(array.shape), array.shape)) if piece != whole)


def one_row_per_device(value: Any) -> bool:
  """Whether `value` is a `jax.Array` with one row of its leading axis on each
  of its devices, as pmap lays out outputs (under `--jaxline_disable_pmap_jit`
  any device array: chex's vmap puts them on one device)."""
  if not isinstance(value, jax.Array) or not value.shape:
    return False
  sharding = value.sharding
  return (value.shape[0] == len(sharding.device_set)
          and sharding.shard_shape(value.shape)[0] == 1) or debugging.pmap_jit_disabled()


def equal_rows(value: Any) -> bool:
  """Whether every row of `value` (along its first axis) equals the first,
  NaN equal to NaN: the first is then all of them. Reads `value` (False
  where this process holds only some of its rows)."""
  if isinstance(value, jax.Array) and not (value.is_fully_addressable
                                           or value.is_fully_replicated):
    return False
  rows = np.asarray(raw_keys(value))
  return np.array_equal(rows, np.broadcast_to(rows[:1], rows.shape),
                        equal_nan=bool(jnp.issubdtype(rows.dtype, jnp.inexact)))


def holds_shape(array: jax.Array, shape: tuple[int, ...], pmap_layout: bool) -> bool:
  """Whether a value of `shape` can take `array`'s place on its devices: any
  size along the axes not split over them (a buffer that grows). Along split
  axes the size must be the same where `pmap_layout` (each device holds one
  row: a pmap value's device axis), and otherwise divide evenly over the devices."""
  if pmap_layout:
    return all(axis < len(shape) and shape[axis] == array.shape[axis]
               for axis in split_axes(array))
  try:
    array.sharding.shard_shape(tuple(shape))
  except (ValueError, IndexError):
    return False
  return True


def restored_like(live: Any, restored: Any) -> Any:
  """`restored` as `live`, the value it replaces, holds it: keys of `live`'s kind
  (typed or raw), and host arrays placed where the live arrays are (committed
  as those were) when `holds_shape` says they fit.
  """

  def like(live_leaf, restored_leaf):
    if is_typed_key(live_leaf) and not is_typed_key(restored_leaf):
      return jax.random.wrap_key_data(restored_leaf, impl=jax.random.key_impl(live_leaf))
    if is_typed_key(restored_leaf) and isinstance(live_leaf, (jax.Array, np.ndarray)) and \
        not is_typed_key(live_leaf):
      return jax.random.key_data(restored_leaf)
    if isinstance(live_leaf, jax.Array) and isinstance(restored_leaf, np.ndarray) and \
        holds_shape(live_leaf, restored_leaf.shape, pmap_layout=False):
      # An uncommitted value stays so: jit moves it to the devices of the
      # arrays it meets, which a value pinned to one device would refuse.
      return jax.device_put(restored_leaf, live_leaf.sharding if live_leaf.committed else None)
    return restored_leaf

  try:
    return jax.tree.map(like, live, restored)
  except (TypeError, ValueError):  # Another structure (a leaf built by the first step): as saved.
    return restored
