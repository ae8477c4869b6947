"""Mesh mode: experiments on `jit` + `NamedSharding` instead of pmap.

With `config.placement = "mesh"` one `jax.sharding.Mesh` spans every device
of every process, shaped by `config.mesh_shape` (`"data:-1,model:2"` or
`{"data": -1, "model": 2}`; -1 is the remaining devices). `step` then gets a
scalar `global_step` and one replicated key, and `CHECKPOINT_ATTRS` hold global
arrays, saved whole and restored onto the shardings the new experiment gave them.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxline_ng import devices, errors, multihost

PLACEMENTS = ("pmap", "mesh")

def _parse_shape(mesh_shape) -> list[tuple[str, int]]:
  if isinstance(mesh_shape, str):
    axes = []
    for part in mesh_shape.split(","):
      name, sep, size = part.strip().partition(":")
      if not sep or not name.isidentifier():
        raise ValueError(f"config.mesh_shape={mesh_shape!r}: expected 'name:size,...', "
                         "e.g. 'data:-1,model:2'")
      axes.append((name, int(size)))
    return axes
  if not hasattr(mesh_shape, "keys"):
    raise ValueError(f"config.mesh_shape={mesh_shape!r}: expected 'name:size,...' or "
                     "{name: size}, e.g. 'data:-1,model:2'")
  return [(name, int(mesh_shape[name])) for name in mesh_shape.keys()]


def mesh_axes(mesh_shape) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Resolves `config.mesh_shape` against `jax.device_count()`.

  Raises ValueError naming the shape when it does not tile the devices.
  """
  try:
    axes = _parse_shape(mesh_shape)
  except ValueError as e:
    if "config.mesh_shape" in str(e):
      raise
    raise ValueError(f"config.mesh_shape={mesh_shape!r}: sizes must be integers") from None
  names = tuple(name for name, _ in axes)
  sizes = [size for _, size in axes]
  devices = jax.device_count()
  shown = mesh_shape if isinstance(mesh_shape, str) else dict(axes)
  if not names or len(set(names)) != len(names) or sum(size == -1 for size in sizes) > 1 or any(
      size == 0 or size < -1 for size in sizes):
    raise ValueError(f"config.mesh_shape={shown!r}: give each axis a distinct name and a "
                     "positive size, at most one -1")
  known = math.prod(size for size in sizes if size != -1)
  if -1 in sizes:
    if devices % known:
      raise ValueError(f"config.mesh_shape={shown!r}: {devices} devices do not "
                       f"split into axes of total size {known} x N")
    sizes[sizes.index(-1)] = devices // known
  if math.prod(sizes) != devices:
    raise ValueError(f"config.mesh_shape={shown!r} has {math.prod(sizes)} "
                     f"positions for {devices} devices")
  return names, tuple(sizes)


def sharding(*spec: Any) -> NamedSharding:
  """`NamedSharding(mesh, PartitionSpec(*spec))` on the run's mesh."""
  return NamedSharding(current_mesh(), PartitionSpec(*spec))


def replicate(tree: Any) -> Any:
  """A copy of `tree` on every device of the mesh (fully replicated)."""
  return place(tree)


def place(tree: Any, *spec: Any) -> Any:
  """Places host or device values on the mesh, sharded by `spec`."""
  target = sharding(*spec)

  def put(path, leaf):
    multihost.check_splits("place: the value", path, np.shape(leaf), target)
    if devices.is_typed_key(leaf):  # A key on one device reaches no other process's.
      return devices.placed_from_host(leaf, lambda data: jax.device_put(data, target))
    return leaf

  return jax.device_put(jax.tree_util.tree_map_with_path(put, tree), target)


def global_batch(local_batch: Any, *spec: Any) -> Any:
  """A global batch from this process's rows (see `multihost.host_slice`), sharded by `spec`."""
  return multihost.global_batch(local_batch, current_mesh(), PartitionSpec(*spec))


def global_batch_from_every_row(batch: Any, *spec: Any) -> Any:
  """A global batch sharded by `spec` from the whole batch, which every process passes alike."""
  return multihost.global_batch_from_every_row(batch, current_mesh(), PartitionSpec(*spec))


def restore_like(live: Any, saved: Any) -> Any:
  """Places saved host values with the shardings of the live values they replace."""

  def put(live_leaf, saved_leaf):
    if devices.is_typed_key(live_leaf):  # Placed as its raw data, then typed again.
      saved_data = (jax.random.key_data(saved_leaf) if devices.is_typed_key(saved_leaf)
                    else saved_leaf)
      return jax.random.wrap_key_data(put(jax.random.key_data(live_leaf), saved_data),
                                      impl=jax.random.key_impl(live_leaf))
    if not isinstance(live_leaf, jax.Array):
      return saved_leaf
    # The saved dtype is the run's: state may change dtype as it trains (a
    # weakly typed scalar scaled by bfloat16 is bfloat16).
    dtype = saved_leaf.dtype if hasattr(saved_leaf, "dtype") else np.result_type(saved_leaf)
    if live_leaf.weak_type and live_leaf.ndim == 0 and dtype == live_leaf.dtype:
      # Still a Python number's weak type, so it goes on taking the dtype of what it meets.
      value = jnp.asarray(np.asarray(saved_leaf).item())
    elif isinstance(saved_leaf, jax.Array) and saved_leaf.sharding == live_leaf.sharding:
      return saved_leaf  # Already placed (a disk checkpoint's arrays, any process count).
    else:
      value = np.asarray(saved_leaf, dtype=dtype)
    # An uncommitted value (optax's `count`) stays so: committed to one device,
    # jit would refuse it beside the mesh's arrays.
    return jax.device_put(value, live_leaf.sharding if live_leaf.committed else None)

  if live is None:
    return saved
  if jax.tree.structure(live) != jax.tree.structure(saved):
    # State grown since `__init__` (a layer added, an EMA filled): restored as
    # saved, as jaxline's setattr did, with host values replicated as model state is.
    return jax.tree.map(
        lambda leaf: replicate(leaf) if isinstance(leaf, (np.ndarray, np.generic)) else leaf, saved)
  return jax.tree.map(put, live, saved)


class PmapPlacement:
  """pmap mode: replicated values carry a leading axis of local devices, a copy on each."""

  name, mesh, mesh_shape, per_device = "pmap", None, None, True
  replicate = staticmethod(devices.bcast_local_devices)

  def one_copy(self, tree: Any, fresh: bool) -> Any:
    return devices.get_first(tree)

  def restored(self, live: Any, saved: Any) -> Any:
    return devices.bcast_local_devices(saved)

  def step_counter(self, global_step: int, on_devices: bool = False) -> Any:
    counter = np.full(jax.local_device_count(), global_step, np.int32)
    return devices.put_per_device(counter) if on_devices else counter


class MeshPlacement:
  """Mesh mode: global arrays over `mesh`, taken whole; a key or step count is one value."""

  name, per_device = "mesh", False
  restored = staticmethod(restore_like)

  def __init__(self, mesh: Mesh):
    self.mesh, self.mesh_shape = mesh, dict(mesh.shape)

  def replicate(self, value: Any) -> Any:
    return devices.placed_from_host(value, replicate)

  def one_copy(self, tree: Any, fresh: bool) -> Any:
    return devices.fresh_copies(tree) if fresh else tree

  def step_counter(self, global_step: int, on_devices: bool = False) -> Any:
    return np.int32(global_step)


PMAP = PmapPlacement()
_active: list[PmapPlacement | MeshPlacement] = [PMAP]


def activate(config) -> Mesh | None:
  """Builds the mesh `config` asks for (or clears it, in pmap mode) and returns it."""
  if config.placement != "mesh":
    _active[0] = PMAP
    return None
  names, sizes = mesh_axes(config.mesh_shape)
  # Auto axes: shardings are placement hints XLA propagates, as jit users
  # expect (`make_mesh` would default to Explicit axes, which type them).
  _active[0] = MeshPlacement(
      jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names)))
  return _active[0].mesh


def placement() -> PmapPlacement | MeshPlacement:
  """How this run places values; the one place the pmap/mesh choice is read.

  Both offer `replicate(value)`: one array or key placed as steps take it;
  `one_copy(tree, fresh)`: one copy of CHECKPOINT_ATTRS values (new buffers if
  `fresh`); `restored(live, saved)`: saved values placed as the live ones;
  `step_counter(global_step, on_devices)`: `global_step` as `step` gets it (new
  host values, so a step changing them leaves the loop's count), or on the devices
  as jaxline gives it to `evaluate`; `per_device`: whether replicated values carry
  a leading device axis.
  """
  return _active[0]


def active_mesh() -> Mesh | None:
  """The run's mesh in mesh mode; None in pmap mode."""
  return _active[0].mesh


class NoMeshError(RuntimeError, errors.OneLineError):
  """A mesh helper called in a run that is not in mesh mode; the message names the config key."""


def current_mesh() -> Mesh:
  """The run's mesh; raises NoMeshError if the run is not in mesh mode."""
  if _active[0].mesh is None:
    raise NoMeshError("the experiment uses the mesh, but config.placement is not 'mesh': set "
                      "it (--config.placement=mesh) to run in mesh mode")
  return _active[0].mesh
