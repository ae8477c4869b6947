"""Random keys for training and evaluation, specialised per host and device (jaxline's streams).

A random mode is `<unique|same>_host_<unique|same>_device`. The seed's key is
split into the training chain and `init_rng`; each step splits the chain,
replicated on every device, into the step's key (specialised by
`random_mode_train`) and the next chain. Evaluation gets the seed's key,
specialised by `random_mode_eval`. A replicated chain resumes on any topology.
"""

import enum

import jax
import jax.numpy as jnp
import numpy as np

from jaxline_ng import debugging, devices
from jaxline_ng import mesh as mesh_lib


class DistributedRNGMode(enum.Enum):
  """The random modes, as jaxline's enum names them."""

  UNIQUE_HOST_UNIQUE_DEVICE = "unique_host_unique_device"
  UNIQUE_HOST_SAME_DEVICE = "unique_host_same_device"
  SAME_HOST_UNIQUE_DEVICE = "same_host_unique_device"
  SAME_HOST_SAME_DEVICE = "same_host_same_device"

  @property
  def unique_host(self) -> bool:
    return self.value.startswith("unique_host_")

  @property
  def unique_device(self) -> bool:
    return self.value.endswith("_unique_device")


RANDOM_MODES = tuple(mode.value for mode in DistributedRNGMode)


def check_random_mode(mode: str, config_key: str) -> None:
  """Raises ValueError naming `config_key` if `mode` is not a random mode."""
  if mode not in RANDOM_MODES:
    raise ValueError(
        f"config.{config_key}={mode!r} is not a random mode; expected one of "
        f"{', '.join(RANDOM_MODES)}")


def host_id_devices_for_rng(mode: str = "unique_host_unique_device"):
  """The per-device host ids to fold into keys, or None when hosts share keys."""
  check_random_mode(mode, "random_mode")
  if not mode.startswith("unique_host_"):
    return None
  return np.full((jax.local_device_count(),), jax.process_index(), np.int32)


def specialize_rng_host_device(rng, host_id, axis_name: str,
                               mode: str = "unique_host_unique_device"):
  """Folds the host id and/or device index into `rng` as `mode` says (jaxline's
  function, called inside a pmap over `axis_name`)."""
  check_random_mode(mode, "random_mode")
  if mode.startswith("unique_host_") and host_id is None:
    raise ValueError(f"random mode {mode!r} needs a host id")
  # The axis is looked up only where it is used: a caller may leave it unbound.
  device = jax.lax.axis_index(axis_name) if mode.endswith("_unique_device") else 0
  return _specialize(rng, mode, host_id, device)


def _specialize(key, mode: str, process: int, device: jax.Array):
  """`key` with this process and the device's position folded in as `mode` says."""
  host_part, _, device_part, _ = mode.split("_")
  if host_part == "unique":
    key = jax.random.fold_in(key, process)
  if device_part == "unique":
    key = jax.random.fold_in(key, device)
  return key


def seed_keys(random_seed: int, legacy_random_seed_behavior: bool):
  """`(train_step_rng, init_rng)`: the training chain's first key and the
  experiment's initialisation key, as jaxline derives them from the seed."""
  key = jax.random.PRNGKey(random_seed)
  if legacy_random_seed_behavior:
    return key, key
  train_key, init_key = jax.random.split(key)
  return train_key, init_key


@debugging.compiled(static_argnames=("mode", "process"))
def _split_step(chain, mode: str, process: int):
  """`(step key, next chain)`: jaxline's split, the step key specialised by `mode`."""
  check_random_mode(mode, "random_mode_train")  # Once per compilation, not per step.
  # Mesh mode: one global key, per-device keys the step's business. A raw key
  # has a trailing axis of 2 that a typed key lacks.
  if chain.ndim == (0 if devices.is_typed_key(chain) else 1):
    step_key, next_chain = jax.random.split(chain)
    return _specialize(step_key, _host_part_only(mode), process, 0), next_chain
  children = jax.vmap(jax.random.split)(chain)  # [devices, 2 (step, chain), 2]
  positions = jnp.arange(chain.shape[0])
  step_keys = jax.vmap(lambda key, position: _specialize(key, mode, process, position))(
      children[:, 0], positions)
  return step_keys, children[:, 1]


class StepKeys:
  """Hands each training step its key and the chain key after it.

  `next(chain)` returns `(step_rng, next_chain)` for the step that starts
  from `chain` (`state.train_step_rng`): `[local devices, 2]` in pmap mode,
  one key in mesh mode. The step's key is specialised by `mode`
  (`config.random_mode_train`; in mesh mode only its host part applies).
  """

  def __init__(self, mode: str):
    self._mode = mode

  def next(self, chain):
    return _split_step(chain, mode=self._mode, process=jax.process_index())


def _host_part_only(mode: str) -> str:
  return mode.replace("unique_device", "same_device")


def check_mesh_random_mode(mode: str, config_key: str) -> None:
  """Raises ValueError if `mode` gives processes different keys in mesh mode,
  where a step takes one global key that must be equal on every process."""
  if mode.startswith("unique_host_") and jax.process_count() > 1:
    raise ValueError(
        f"config.{config_key}={mode!r} gives each process its own key, but a mesh-mode "
        "step takes one global key: use same_host_* and fold in jax.process_index() or "
        "jax.lax.axis_index where keys must differ")


def place_chain(value, like=None):
  """A restored chain key placed for this run's topology, typed as `like` (else `value`).

  A chain saved on another device count continues from its first row when all
  rows are equal (the default); differing per-device chains resume only on as
  many devices.
  """
  typed = like if like is not None else value
  if devices.is_typed_key(value):
    value = jax.random.key_data(value)
  value = np.asarray(jax.device_get(value))
  placement = mesh_lib.placement()
  if placement.per_device and value.ndim == 2 and value.shape[0] == jax.local_device_count():
    placed = devices.put_per_device(value)
  else:
    placed = placement.replicate(value if value.ndim == 1 else _common_row(value))
  if devices.is_typed_key(typed):
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(typed))
  return placed


def _common_row(rows: np.ndarray) -> np.ndarray:
  if not (rows == rows[:1]).all():
    raise ValueError(
        f"the checkpoint's train_step_rng has {rows.shape[0]} different per-device keys, "
        f"so it resumes only on {rows.shape[0]} local devices (this process has "
        f"{jax.local_device_count()})")
  return rows[0]


def eval_keys(random_seed: int, mode: str):
  """The keys `evaluate` receives at every call: the seed's key specialised by
  `mode` per local device (pmap), or one global key (mesh mode, host part only)."""
  check_random_mode(mode, "random_mode_eval")
  key = jax.random.PRNGKey(random_seed)
  placement = mesh_lib.placement()
  if not placement.per_device:
    check_mesh_random_mode(mode, "random_mode_eval")
    return placement.replicate(_specialize(key, _host_part_only(mode), jax.process_index(), 0))
  keys = jax.vmap(lambda position: _specialize(key, mode, jax.process_index(), position))(
      jnp.arange(jax.local_device_count()))
  return devices.placed_from_host(keys, devices.put_per_device)


# The largest step count a step's `global_step` holds: jaxline's is int32.
MAX_STEP = int(np.iinfo(np.int32).max)

