"""Placing pmap-replicated state on the local devices and reading it back.

Since JAX 0.8 a pmap output is a `jax.Array` with a `NamedSharding` over a
one-axis mesh of the local devices. Indexing it (`x[0]`) gathers every shard
to one device, which costs hundreds of microseconds per leaf; the functions
here read the first device's shard instead, and place replicated values with
one `jax.device_put` per leaf.
"""

import abc
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

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


# Batches of this many steps' scalars are stacked by one dispatch each
# (`stage_first_shards_read`); the stack compiles once per size and structure.
_STACK_SIZES = (64, 16)


@jax.jit
def _stack_columns(columns):
  return [jnp.stack(column) for column in columns]


def first_shards_to_host(tree: Any) -> Any:
  """`jax.device_get(first_shards(tree))`: one transfer per array, no dispatch.

  Safe on any thread: it runs no device computation, so it never takes one
  of XLA's in-flight slots (see `experiment.steps_in_flight_limit`).
  """
  return jax.device_get(first_shards(tree))


def stage_first_shards_read(trees: list[Any]) -> Callable[[], list[Any]]:
  """Starts `first_shards_to_host(trees)` for many trees of one structure.

  Meant for a batch of steps' scalars: reading each step's arrays apart
  costs ~25 us an array (taking the first shard of a new array, then a
  transfer). Arrays at the same place in consecutive trees (same shape,
  dtype and sharding) are stacked on their devices instead, by one
  dispatch per `_STACK_SIZES` chunk with no data crossing devices, and only
  each stack's first shard is copied. A lone tree is read as it is.

  The stacking is dispatched here, on the calling thread: call this on the
  thread that dispatches the training steps. The returned function does the
  rest (transfers only) and may run on any thread.
  """
  if not trees:
    return lambda: []
  flat = [jax.tree.flatten(tree) for tree in trees]
  first_leaves, treedef = flat[0]
  stackable = [i for i, leaf in enumerate(first_leaves) if _first_shard_holds_one_copy(leaf)]
  if not stackable or any(other_treedef != treedef for _, other_treedef in flat):
    return functools.partial(first_shards_to_host, trees)

  others_on_device = any(isinstance(leaf, jax.Array) for i, leaf in enumerate(first_leaves)
                         if i not in stackable)

  def signature(leaves):
    return [(leaves[i].shape, leaves[i].dtype, leaves[i].sharding) if isinstance(
        leaves[i], jax.Array) else None for i in stackable]

  # Per chunk: (its trees, None) to read them apart, or (each tree's leaves, the stacks).
  chunks = []
  start = 0
  while start < len(trees):
    remaining = len(trees) - start
    size = next((size for size in _STACK_SIZES if size <= remaining), remaining)
    chunk = [leaves for leaves, _ in flat[start:start + size]]
    first_signature = signature(chunk[0])
    if size == 1 or any(signature(leaves) != first_signature for leaves in chunk[1:]):
      chunks.append((trees[start:start + size], None))
    else:
      # A short last chunk is padded with copies of its last step, so every
      # stack has one of the `_STACK_SIZES` (no compilation per batch length).
      padded = chunk + [chunk[-1]] * (_STACK_SIZES[-1] - size)
      chunks.append((chunk, _stack_columns([[leaves[i] for leaves in padded]
                                            for i in stackable])))
    start += size

  def read() -> list[Any]:
    host_trees = []
    for chunk, stacks in chunks:
      if stacks is None:
        host_trees += first_shards_to_host(chunk)
        continue
      host_stacks = jax.device_get([stack.addressable_data(0) for stack in stacks])
      for row, leaves in enumerate(chunk):
        host_leaves = list(leaves)
        for i, host_stack in zip(stackable, host_stacks):
          host_leaves[i] = host_stack[row]
        host_tree = jax.tree.unflatten(treedef, host_leaves)
        host_trees.append(jax.device_get(host_tree) if others_on_device else host_tree)
    return host_trees

  return read


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


class DeferredHostValue(abc.ABC):
  """Part of a checkpoint snapshot that becomes host data only on the saving thread.

  The training thread puts it in the snapshot for the price of a dispatch
  or less; `to_host()` (see `to_host`) does the copying, later, elsewhere.
  """

  @abc.abstractmethod
  def to_host(self) -> Any:
    """The value as host (NumPy) data; may wait for the devices."""


def to_host(tree: Any) -> Any:
  """`jax.device_get(tree)`, with every `DeferredHostValue` replaced by its `to_host()`."""
  def is_deferred(x):
    return isinstance(x, DeferredHostValue)

  def host_value(x):
    if is_deferred(x):
      return x.to_host()
    return jax.device_get(x) if isinstance(x, jax.Array) else x

  return jax.tree.map(host_value, tree, is_leaf=is_deferred)


def _buffer_kind(dtype) -> Any:
  """Which packed buffer a leaf of `dtype` goes in: integers and floats of one
  width share an unsigned carrier (bit-cast, so values are kept exactly);
  other dtypes (bool, keys, complex) get a buffer of their own dtype."""
  if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating):
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
  return dtype


@functools.partial(jax.jit, static_argnames=("groups", "mesh"))
def _pack_rows(leaves, groups, mesh):
  """Per group `(kind, leaf indices)`, the first device's row of its leaves,
  flattened, bit-cast to the group's carrier and concatenated: [D, n], the
  other devices' rows zeros.

  `mesh` is the first leaf's one-axis mesh. Only the first device copies: the
  others, each holding its own replica, fill their row with zeros (writes
  without reads). On 4 CPU devices the benchmark MLP's pack took 213 us
  this way and 438 us when every device copied (ready inputs), and a save
  every 10 steps slowed training by 2.4 % instead of 4.1 % (in-process A/B,
  90 interleaved pairs).
  """
  axis = mesh.axis_names[0]

  def pack_on_each_device(*device_leaves):  # Each leaf [1, ...]: this device's row.
    def concatenated():
      buffers = []
      for kind, group in groups:
        rows = [device_leaves[i].reshape(1, -1) for i in group]
        rows = [row if row.dtype == kind else jax.lax.bitcast_convert_type(row, kind)
                for row in rows]
        buffers.append(jnp.concatenate(rows, axis=1))
      return buffers

    def zeros():
      return [jax.lax.pcast(jnp.zeros(buffer.shape, buffer.dtype), (axis,), to="varying")
              for buffer in jax.eval_shape(concatenated)]

    return jax.lax.cond(jax.lax.axis_index(axis) == 0, concatenated, zeros)

  return jax.shard_map(pack_on_each_device, mesh=mesh, in_specs=PartitionSpec(axis),
                       out_specs=PartitionSpec(axis))(*leaves)


class _PackPlan(NamedTuple):
  treedef: Any
  mesh: Mesh  # The first leaf's one-axis mesh; the others' have its devices in its order.
  groups: tuple[tuple[Any, tuple[int, ...]], ...]  # (buffer kind, leaf indices)
  placement: tuple[tuple[int, int, tuple[int, ...], Any], ...]  # (buffer, offset, shape, dtype)


def _one_axis_mesh(sharding: jax.sharding.Sharding) -> Optional[Mesh]:
  """The mesh of a sharding over one mesh axis of this process's devices (a
  pmap output's or `put_per_device`'s), else None."""
  if (not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh)
      or len(sharding.mesh.axis_names) != 1 or not sharding.is_fully_addressable):
    return None
  return sharding.mesh


@functools.lru_cache(maxsize=256)
def _pack_plan(treedef, signature) -> Optional[_PackPlan]:
  """How leaves with `signature` ((shape, dtype, sharding) each) are packed, or
  None when one is not a per-device array over one mesh axis of the local
  devices, or the leaves' meshes order the devices differently.

  Cached: a run saves the same structure every time, and working this out
  per leaf cost a save ~30 us of the training thread.
  """
  count = jax.local_device_count()
  if not signature or not all(shape and shape[0] == count and _per_device_layout(sharding, shape)
                              for shape, _, sharding in signature):
    return None
  # Leaves of a pmap's outputs and of `put_per_device` sit on meshes named
  # after different axes; what matters is that rows go to devices in one order.
  meshes = [_one_axis_mesh(sharding) for _, _, sharding in signature]
  if None in meshes or len({tuple(mesh.devices.flat) for mesh in meshes}) != 1:
    return None
  groups: dict[Any, list[int]] = {}
  for i, (_, dtype, _) in enumerate(signature):
    groups.setdefault(_buffer_kind(dtype), []).append(i)
  placement, offsets = [None] * len(signature), [0] * len(groups)
  for buffer, group in enumerate(groups.values()):
    for i in group:
      shape, dtype, _ = signature[i]
      placement[i] = (buffer, offsets[buffer], shape[1:], dtype)
      offsets[buffer] += math.prod(shape[1:])
  return _PackPlan(treedef, meshes[0],
                   tuple((kind, tuple(group)) for kind, group in groups.items()),
                   tuple(placement))


class PackedFirst(DeferredHostValue):
  """The first device's copy of a pmap-replicated pytree, packed into few buffers.

  `pack` costs one dispatch, however many leaves the tree has, with one
  output per group of same-width numbers (`_buffer_kind`: an MLP's float32
  weights and int32 step counts share one): the first device concatenates
  its own copy, so no data crosses devices. Picking that device's row, the
  copy to the host and rebuilding the tree (of NumPy views into the
  buffers) wait for `to_host`: taking one device's part of a new array
  costs ~12 us per array, which a save every few steps would otherwise pay
  per leaf on the training thread.
  """

  def __init__(self, buffers, plan: _PackPlan):
    self.buffers = buffers  # One [devices, n] array per group.
    self._plan = plan
    self._host_tree = None

  @staticmethod
  def _leaves_and_plan(tree: Any) -> tuple[list[Any], Optional[_PackPlan]]:
    leaves, treedef = jax.tree.flatten(tree)
    if not all(isinstance(leaf, jax.Array) for leaf in leaves):
      return leaves, None
    return leaves, _pack_plan(
        treedef, tuple((leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves))

  @classmethod
  def pack(cls, tree: Any) -> Optional["PackedFirst"]:
    """`tree` packed, or None if `can_pack(tree)` is False."""
    leaves, plan = cls._leaves_and_plan(tree)
    if plan is None:
      return None
    return cls(_pack_rows(leaves, groups=plan.groups, mesh=plan.mesh), plan)

  @classmethod
  def can_pack(cls, tree: Any) -> bool:
    """Whether every leaf is a per-device array (pmap layout) over the local
    devices, all in one order."""
    return cls._leaves_and_plan(tree)[1] is not None

  def to_host(self) -> Any:
    """The tree, copied once (later calls return the same host tree)."""
    if self._host_tree is None:
      rows = jax.device_get([buffer.addressable_data(0) for buffer in self.buffers])
      leaves = [rows[buffer][0, offset:offset + math.prod(shape)].view(dtype).reshape(shape)
                for buffer, offset, shape, dtype in self._plan.placement]
      self._host_tree = jax.tree.unflatten(self._plan.treedef, leaves)
    return self._host_tree


class PackedEntry(DeferredHostValue):
  """One value of a dict packed by `PackedFirst`: what `to_host()` of the whole has at `key`."""

  def __init__(self, packed: PackedFirst, key: Any):
    self._packed = packed
    self._key = key

  def to_host(self) -> Any:
    return self._packed.to_host()[self._key]


def packed_first(tree: dict[Any, Any]) -> dict[Any, Any]:
  """`get_first(tree)` of a dict, packed when it can be: the dict's values as
  `PackedEntry`s of one `PackedFirst` (one dispatch), or as `get_first` copies."""
  packed = PackedFirst.pack(tree)
  if packed is None:
    return get_first(tree)
  return {key: PackedEntry(packed, key) for key in tree}


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


def tree_psum(tree: Any, axis_name: str) -> Any:
  """`jax.lax.psum` of every leaf over `axis_name`; call inside pmap/shard_map."""
  return jax.tree.map(functools.partial(jax.lax.psum, axis_name=axis_name), tree)
