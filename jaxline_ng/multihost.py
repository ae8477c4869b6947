"""Helpers for code that runs in every process of a multi-process run.

Every process must issue its cross-process device collectives (a jitted step
over global arrays, `process_allgather`, `jax.device_put` onto other processes'
devices) in the same order, or the run deadlocks. jaxline_ng issues them on the
training thread only (`own_collectives`); other threads agree through the
runtime's key-value store (`agreement`). The helpers here that run a collective
refuse another thread, naming it, instead of hanging the run.
"""

import functools
import math
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxline_ng import errors
from jaxline_ng.agreement import (
    barrier,
    begin_run,
    check_same_as_chief,
    exchange,
    publish_failure,
    rendezvous,
)
from jaxline_ng.distributed import (
    MultihostError,
    initialize_if_requested,
    is_chief,
    is_multiprocess,
)

# The thread that issues this process's cross-process collectives.
_collectives_thread: threading.Thread | None = None


def own_collectives() -> None:
  """Makes the calling thread the one that issues cross-process collectives
  (`train` and `evaluate` call it as they start)."""
  global _collectives_thread  # pylint: disable=global-statement
  _collectives_thread = threading.current_thread()


class CollectiveThreadError(RuntimeError):
  """A cross-process collective was called off the training thread."""


def _check_collective_thread(what: str) -> None:
  """Raises CollectiveThreadError if a collective would be issued off the training thread."""
  thread = threading.current_thread()
  if is_multiprocess() and _collectives_thread not in (None, thread):
    raise CollectiveThreadError(
        f"{what} is a collective across processes, called on thread {thread.name!r}: every "
        "process must issue collectives in one order, so call it from step or evaluate (the "
        f"training thread, {_collectives_thread.name!r}), never from a prefetch or other "
        "background thread")


class ShardingShapeError(ValueError, errors.OneLineError):
  """An array whose axis does not split over the mesh axes its spec maps it to; the message
  names the value, its shape and the axes."""


def check_splits(what: str, path: tuple[Any, ...], shape: tuple[int, ...],
                 sharding: jax.sharding.NamedSharding) -> None:
  """Raises ShardingShapeError unless every axis of `shape` splits evenly
  over the mesh axes `sharding`'s spec maps it to (JAX's own error is a
  traceback from deep inside `device_put`).

  Args:
    what: names the value in the error, e.g. "global_batch: the global batch".
    path: the value's key path in its pytree, appended to `what`.
    shape: the value's (global) shape.
    sharding: where it is to be placed.
  """
  for dim, names in enumerate(sharding.spec[:len(shape)]):
    names = names if isinstance(names, tuple) else (names,)
    if not all(isinstance(name, str) for name in names):
      continue  # None (replicated) or unconstrained.
    parts = math.prod(sharding.mesh.shape[name] for name in names)
    if shape[dim] % parts:
      raise ShardingShapeError(
          f"{what}{jax.tree_util.keystr(path)} of shape {tuple(shape)}: its axis {dim} "
          f"({shape[dim]}) does not split over mesh axis {' x '.join(map(repr, names))} of "
          f"{parts} devices; make it a multiple of {parts}")


def host_slice(global_rows: Any) -> Any:
  """This process's contiguous `1 / process_count` of arrays whose leading axis
  spans every device. Raises ShardingShapeError if the leading axis does not split evenly.
  """
  count, index = jax.process_count(), jax.process_index()

  def take(rows):
    rows = np.asarray(rows)
    share, remainder = divmod(rows.shape[0], count)
    if remainder:
      raise ShardingShapeError(
          f"host_slice: {rows.shape[0]} rows do not split over {count} processes")
    return rows[index * share:(index + 1) * share]

  return jax.tree.map(take, global_rows)


def global_batch(local_batch: Any, mesh: jax.sharding.Mesh, spec: Any) -> Any:
  """Assembles per-process rows into global `jax.Array`s sharded by `spec` over `mesh`.

  Each process passes its own rows (its `host_slice`); the result holds every
  process's rows in process order. When `spec` puts on a process's devices rows
  another process holds (e.g. `data:1,model:4` over 2 processes), each call
  gathers all rows, a collective: off the training thread use
  `global_batch_from_every_row`.

  Raises:
    CollectiveThreadError: a gather is needed off the training thread.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)
  count = jax.process_count()

  def assemble(path, rows):
    rows = np.asarray(rows)
    if rows.ndim == 0:
      return jax.make_array_from_process_local_data(sharding, rows)
    global_shape = (count * rows.shape[0], *rows.shape[1:])
    check_splits("global_batch: the global batch", path, global_shape, sharding)
    if count == 1:
      return jax.make_array_from_process_local_data(sharding, rows)
    if not _holds_its_own_rows(sharding, global_shape):
      # Every process decides alike (same sharding and shapes), so all gather.
      _check_collective_thread(
          f"global_batch over mesh {dict(mesh.shape)} with PartitionSpec{tuple(spec)} (it "
          "gathers rows other processes load; global_batch_from_every_row does not)")
      rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    return jax.make_array_from_process_local_data(sharding, rows, global_shape)

  return jax.tree_util.tree_map_with_path(assemble, local_batch)


def global_batch_from_every_row(batch: Any, mesh: jax.sharding.Mesh, spec: Any) -> Any:
  """Global `jax.Array`s sharded by `spec` over `mesh`, from the whole batch.

  Every process passes the same rows and places only those its devices hold:
  no collective, so a prefetch thread may call it.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)

  def place(path, rows):
    rows = np.asarray(rows)
    check_splits("global_batch_from_every_row: the batch", path, rows.shape, sharding)
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

  return jax.tree_util.tree_map_with_path(place, batch)


@functools.cache
def _holds_its_own_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> bool:
  """Whether the devices of each process `p` hold exactly its `host_slice`:
  rows `[p * share, (p + 1) * share)` of the leading axis, nothing else."""
  share = global_shape[0] // jax.process_count()
  blocks: dict[int, set[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map(global_shape).items():
    start, stop, _ = index[0].indices(global_shape[0])
    blocks.setdefault(device.process_index, set()).add((start, stop))
  for process, held in blocks.items():
    end = process * share
    for start, stop in sorted(held):
      if start != end:
        return False
      end = stop
    if end != (process + 1) * share:
      return False
  return True


def broadcast_from_chief(tree: Any) -> Any:
  """Process 0's value of `tree` on every process (e.g. a seed or a file list)."""
  if jax.process_count() == 1:
    return tree
  _check_collective_thread("broadcast_from_chief")
  return multihost_utils.broadcast_one_to_all(tree)


def all_reduce_sum(tree: Any) -> Any:
  """The sum over processes of each process's host values (numpy arrays or numbers)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  _check_collective_thread("all_reduce_sum")
  gathered = multihost_utils.process_allgather(tree)
  return jax.tree.map(lambda x: np.asarray(x).sum(axis=0), gathered)


__all__ = [
    "CollectiveThreadError", "MultihostError", "ShardingShapeError", "all_reduce_sum", "barrier",
    "begin_run", "broadcast_from_chief", "check_same_as_chief", "check_splits", "exchange",
    "global_batch", "global_batch_from_every_row", "host_slice", "initialize_if_requested",
    "is_chief", "is_multiprocess", "own_collectives", "publish_failure", "rendezvous",
]
