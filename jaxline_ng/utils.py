"""jaxline's `utils` names, re-exported from the modules that own them.

Published experiments import these from `jaxline.utils`. Rebinding
`utils.GLOBAL_CHECKPOINT_DICT` rebinds `checkpointing`'s too (`_RebindsCheckpointDict`).
"""

import sys
import types

# Tests written for jaxline patch through these: `mock.patch.object(utils.jax, ...)`.
import jax
from absl import logging  # noqa: F401

from jaxline_ng import checkpointing
from jaxline_ng.checkpointing import (
    GLOBAL_CHECKPOINT_DICT,
    Checkpointer,
    CheckpointNT,
    InMemoryCheckpointer,
    SnapshotNT,
    get_checkpoint_dir,
)
from jaxline_ng.debugging import debugger_fallback, disable_pmap_jit
from jaxline_ng.devices import bcast_local_devices, get_first, maybe_device_get
from jaxline_ng.experiment import evaluate_should_return_dict, kwargs_only, log_activity
from jaxline_ng.multihost import rendezvous
from jaxline_ng.periodic import PeriodicAction, make_async
from jaxline_ng.prefetch import double_buffer, double_buffer_on_gpu, py_prefetch
from jaxline_ng.rng import DistributedRNGMode, host_id_devices_for_rng, specialize_rng_host_device
from jaxline_ng.writers import Writer

# jaxline's name for `jax.lax.psum`, which sums pytrees and takes all its arguments.
tree_psum = jax.lax.psum


def __getattr__(name: str):
  """`utils.chex`, imported when first asked for, as tests patch
  `utils.chex.fake_pmap_and_jit`; only debugging runs need chex otherwise."""
  if name == "chex":
    import chex  # pylint: disable=import-outside-toplevel
    return chex
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RebindsCheckpointDict(types.ModuleType):
  """This module, whose `GLOBAL_CHECKPOINT_DICT` rebinds `checkpointing`'s too."""

  def __setattr__(self, name: str, value) -> None:
    super().__setattr__(name, value)
    if name == "GLOBAL_CHECKPOINT_DICT":
      checkpointing.GLOBAL_CHECKPOINT_DICT = value


sys.modules[__name__].__class__ = _RebindsCheckpointDict


__all__ = [
    "CheckpointNT", "Checkpointer", "DistributedRNGMode", "GLOBAL_CHECKPOINT_DICT",
    "InMemoryCheckpointer", "PeriodicAction", "SnapshotNT", "Writer", "bcast_local_devices",
    "debugger_fallback", "disable_pmap_jit", "double_buffer", "double_buffer_on_gpu",
    "evaluate_should_return_dict", "get_checkpoint_dir", "get_first", "host_id_devices_for_rng",
    "kwargs_only", "log_activity", "make_async", "maybe_device_get", "py_prefetch", "rendezvous",
    "specialize_rng_host_device", "tree_psum",
]
