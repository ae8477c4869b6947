"""Placing pmap-replicated state on the local devices and reading it back.

Since JAX 0.8 a pmap output is a `jax.Array` with a `NamedSharding` over a
one-axis mesh of the local devices. Indexing it (`x[0]`) gathers every shard
to one device, which costs hundreds of microseconds per leaf; the functions
here read the first device's shard instead, and place replicated values with
one `jax.device_put` per leaf.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The axis name of the mesh per-device data is placed on. pmap's compile cache
# is keyed on its inputs' mesh, axis names included, and a pmap's outputs live
# on a mesh named after its `axis_name`: placing state on a mesh named "i",
# the name jaxline experiments pass to pmap, means the step that consumes the
# framework's arrays first and its own outputs afterwards compiles once, not
# twice. A pmap with another axis name compiles a second time at step 2.
DEVICE_AXIS = "i"


@functools.cache
def local_mesh() -> Mesh:
  """A one-axis mesh over this process's devices, in `jax.local_devices()` order."""
  return Mesh(np.array(jax.local_devices()), (DEVICE_AXIS,))


@functools.cache
def per_device_sharding() -> NamedSharding:
  """Shards axis 0 of an array over the local devices: pmap's input layout."""
  return NamedSharding(local_mesh(), PartitionSpec(DEVICE_AXIS))


def put_per_device(tree: Any) -> Any:
  """Places arrays whose leading axis is the local device count, one row per device."""
  return jax.device_put(tree, per_device_sharding())


def bcast_local_devices(value: Any) -> Any:
  """Replicates a pytree onto every local device, adding a leading device axis.

  The result is what `jax.pmap` takes as a replicated argument and what the
  `CHECKPOINT_ATTRS` of an experiment hold.
  """
  num_devices = jax.local_device_count()

  def broadcast(leaf):
    host_value = np.asarray(jax.device_get(leaf))
    return np.broadcast_to(host_value, (num_devices,) + host_value.shape)

  return put_per_device(jax.tree.map(broadcast, value))


@jax.jit
def _drop_leading_axis(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _local_copies(leaf: jax.Array) -> int:
  """How many of this process's devices hold part of `leaf`.

  Read from the sharding, which arrays share: `addressable_shards` would
  build a shard object per device for every new array (~40 us).
  """
  return len(leaf.sharding.addressable_devices)


def _first_shard(leaf):
  if isinstance(leaf, jax.Array) and _local_copies(leaf) > 1:
    return leaf.addressable_data(0)
  return leaf


def _is_per_device(leaf: jax.Array) -> bool:
  """Whether axis 0 of `leaf` is one row per addressable device (pmap's layout)."""
  return _per_device_layout(leaf.sharding, leaf.shape)


@functools.lru_cache(maxsize=4096)
def _per_device_layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
  # Cached: a save asks it of every leaf of the model, and a model's leaves
  # share a few shardings and shapes.
  return bool(shape) and shape[0] == len(sharding.addressable_devices) and \
      sharding.shard_shape(shape)[0] == 1


def _first_shard_holds_one_copy(leaf) -> bool:
  """Whether `leaf` is a multi-device array whose first shard is one whole copy:
  replicated (the value) or per-device (the first device's row)."""
  return isinstance(leaf, jax.Array) and _local_copies(leaf) > 1 and (
      leaf.is_fully_replicated or _is_per_device(leaf))


def _first_shard_if_one_copy(leaf):
  return leaf.addressable_data(0) if _first_shard_holds_one_copy(leaf) else leaf


def first_shards(tree: Any) -> Any:
  """`tree` with each multi-device array read on the first local device where that suffices.

  A replicated array becomes its first shard (the whole value), a per-device
  (pmap) array its first row, kept as a `[1, ...]` array; other leaves are
  unchanged. Host code that reads one copy of step outputs (logging, the
  non-finite guard) then transfers one buffer per array instead of one per
  device. No dispatch, no copy: the shards are the inputs' own buffers.
  """
  return jax.tree.map(_first_shard_if_one_copy, tree)


def first_shards_to_host(tree: Any) -> Any:
  """`jax.device_get(first_shards(tree))`: one transfer per array, no dispatch.

  It runs no device computation, so it is safe on any thread.
  """
  return jax.device_get(first_shards(tree))


def get_first(tree: Any) -> Any:
  """Returns the first device's copy of a pmap-replicated pytree.

  Reads the first addressable shard of each array instead of indexing the
  global array, so nothing is gathered across devices. The result holds
  fresh buffers: donating the replicated input later does not invalidate it.
  Non-JAX leaves (numpy arrays, Python numbers) are indexed as jaxline did.
  """
  leaves, treedef = jax.tree.flatten(tree)
  # One dispatch per device the first rows are on: one, unless arrays order
  # their devices differently (a jit takes arrays of one device set).
  by_device: dict[Any, list[tuple[int, jax.Array]]] = {}
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.Array):
      shard = _first_shard(leaf)
      by_device.setdefault(frozenset(shard.sharding.device_set), []).append((i, shard))
  for group in by_device.values():
    firsts = _drop_leading_axis([shard for _, shard in group])
    for (position, _), first in zip(group, firsts):
      leaves[position] = first
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, jax.Array):
      leaves[i] = leaf[0]
  return jax.tree.unflatten(treedef, leaves)


@jax.jit
def _copy_on_device(arrays):
  return [jnp.copy(x) for x in arrays]


def fresh_copies(tree: Any) -> Any:
  """`tree` with every `jax.Array` copied on its devices (dispatched, not waited for).

  The copies are new buffers: donating or deleting the originals later does
  not touch them. One dispatch per placement, as a jit takes arrays of one
  device set.
  """
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


def tree_psum(tree: Any, axis_name: str) -> Any:
  """`jax.lax.psum` of every leaf over `axis_name`; call inside pmap/shard_map."""
  return jax.tree.map(functools.partial(jax.lax.psum, axis_name=axis_name), tree)
