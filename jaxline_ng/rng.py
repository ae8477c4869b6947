"""Random keys for training and evaluation, specialised per host and device.

A random mode is `<host>_host_<device>_device` with each part `unique` or
`same`: `unique_host_unique_device` gives every device of every process its
own key, `same_host_same_device` gives all of them the same key. Keys are raw
`uint32[2]` keys (what `jax.random.PRNGKey` returns), stacked per device.

The training keys form a chain: each step `c -> split(c) = (c', k)` hands the
step the child `k` and keeps `c'` for the next step. Whatever the experiment
derives from `k` never reappears as a later step's key, and resuming from a
checkpointed chain key continues the exact sequence.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxline_ng import devices
from jaxline_ng import mesh as mesh_lib

RANDOM_MODES = (
    "unique_host_unique_device",
    "unique_host_same_device",
    "same_host_unique_device",
    "same_host_same_device",
)

# Folded into the seed so the training chain differs from the key that
# initialises the experiment (`init_rng`), unless legacy behaviour is asked for.
_TRAIN_STREAM = 1

# Steps whose keys are computed by one device dispatch; the loop then hands
# out ready arrays. Each step still costs its key array (~1 us per device
# buffer on 4 CPU devices); 32 makes the dispatch itself ~3 us per step, and
# compiles in ~0.3 s, off the critical path (`compile_ahead`).
STEPS_PER_DISPATCH = 32


def check_random_mode(mode: str, config_key: str) -> None:
  """Raises ValueError naming `config_key` if `mode` is not a random mode."""
  if mode not in RANDOM_MODES:
    raise ValueError(
        f"config.{config_key}={mode!r} is not a random mode; expected one of "
        f"{', '.join(RANDOM_MODES)}")


def host_id_devices_for_rng(mode: str = "unique_host_unique_device"):
  """The per-device host ids to fold into keys, or None when hosts share keys."""
  if not mode.startswith("unique_host_"):
    return None
  return np.full((jax.local_device_count(),), jax.process_index(), np.int32)


def specialize_rng_host_device(rng, host_id, axis_name: str, mode: str):
  """Folds the host id and/or device index into `rng` as `mode` says.

  Call inside a pmap over `axis_name` (jaxline's contract); `host_id` is this
  device's entry of `host_id_devices_for_rng(mode)`, or None.
  """
  check_random_mode(mode, "random_mode")
  host_part, _, device_part, _ = mode.split("_")
  if host_part == "unique":
    if host_id is None:
      raise ValueError(f"random mode {mode!r} needs a host id")
    rng = jax.random.fold_in(rng, host_id)
  if device_part == "unique":
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
  return rng


def _specialize_rows(keys, host_ids, mode):
  """`keys` is [devices, 2]; folds in host id and device position as `mode` says."""
  host_part, _, device_part, _ = mode.split("_")
  positions = jnp.arange(keys.shape[0])

  def one_device(key, host_id, position):
    if host_part == "unique":
      key = jax.random.fold_in(key, host_id)
    if device_part == "unique":
      key = jax.random.fold_in(key, position)
    return key

  return jax.vmap(one_device)(keys, host_ids, positions)


_specialize_per_device = jax.jit(_specialize_rows, static_argnames=("mode",))


@functools.partial(jax.jit, static_argnames=("random_seed", "train_stream", "mode"))
def _seeded_per_device_keys(host_ids, random_seed, train_stream, mode):
  """`per_device_keys` of the seed's key (folded into the train stream if asked), in one
  compiled function: start-up pays one compilation instead of three."""
  key = jax.random.PRNGKey(random_seed)
  if train_stream:
    key = jax.random.fold_in(key, _TRAIN_STREAM)
  return _specialize_rows(jnp.broadcast_to(key, (host_ids.shape[0], 2)), host_ids, mode)


def seeded_run_keys(random_seed: int, mode: str, *, train_stream: bool):
  """The run's starting keys from its seed, placed for the run: per device
  (`per_device_keys`) or one (`mesh_key`), of the seed key or, with
  `train_stream`, of `train_chain_key(seed, legacy=False)`."""
  if mesh_lib.active_mesh() is not None:
    key = train_chain_key(random_seed, not train_stream)
    return mesh_key(key, mode)
  check_random_mode(mode, "random_mode")
  host_ids = np.full((jax.local_device_count(),), jax.process_index(), np.int32)
  return devices.put_per_device(_seeded_per_device_keys(
      host_ids, random_seed=random_seed, train_stream=train_stream, mode=mode))


def per_device_keys(key, mode: str):
  """Stacks `key` per local device and specialises it per host/device by `mode`.

  Returns a `uint32[local_devices, 2]` array placed one row per device.
  """
  check_random_mode(mode, "random_mode")
  num_devices = jax.local_device_count()
  stacked = np.broadcast_to(np.asarray(jax.device_get(key)), (num_devices, 2))
  host_ids = np.full((num_devices,), jax.process_index(), np.int32)
  return devices.put_per_device(_specialize_per_device(stacked, host_ids, mode=mode))


def mesh_key(key, mode: str):
  """The one key of a mesh-mode run, replicated over the mesh.

  The host part of `mode` applies (the process index is folded in for
  `unique_host_*`); the device part does not, since a mesh-mode step sees a
  single key: fold in `jax.lax.axis_index` inside `shard_map` for per-device
  keys. A global replicated key must be equal on every process, so with
  several processes only `same_host_*` modes are possible.
  """
  check_random_mode(mode, "random_mode")
  if mode.startswith("unique_host_"):
    if jax.process_count() > 1:
      raise ValueError(
          f"random mode {mode!r} gives each process its own key, but a mesh-mode step "
          "takes one global key: use same_host_* and fold in jax.process_index() or "
          "jax.lax.axis_index where keys must differ")
    key = jax.random.fold_in(key, jax.process_index())
  return mesh_lib.replicate(np.asarray(jax.device_get(key)))


def place_chain(value):
  """Puts a restored chain key back on the devices, as the run's placement wants."""
  value = np.asarray(jax.device_get(value))
  if mesh_lib.active_mesh() is None:
    return devices.put_per_device(value)
  return mesh_lib.replicate(value)


@jax.jit
def _fold_in_step(chain, step):
  fold = jax.vmap(jax.random.fold_in, in_axes=(0, None)) if chain.ndim == 2 else jax.random.fold_in
  return fold(chain, step)


def fold_in_step(chain, global_step: int):
  """`chain` (this run's starting key chain) with `global_step` folded in, placed alike.

  What a run resumed on another topology (device or process count, placement)
  continues with: the saved chain has another shape there, so its exact
  sequence cannot continue, but this one is deterministic in the seed and step.
  """
  return place_chain(_fold_in_step(chain, np.uint32(global_step)))


def seed_key(random_seed: int):
  """The raw key experiments are initialised with (`init_rng`)."""
  return jax.random.PRNGKey(random_seed)


def train_chain_key(random_seed: int, legacy_random_seed_behavior: bool):
  """The first key of the training chain, before per-device specialisation."""
  key = seed_key(random_seed)
  if legacy_random_seed_behavior:
    return key
  return jax.random.fold_in(key, _TRAIN_STREAM)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _advance_steps(chain, num_steps):
  """The step keys and chain keys of the next `num_steps` steps.

  `chain` is one key (mesh mode) or one per device (pmap mode, [devices, 2]).
  Returns the per-step keys as a list (each step gets a ready array, no
  dispatch), the chain keys after each step stacked in one array (read only
  when a checkpoint asks, see `PendingChainKey`), and the last of them. A
  scan keeps compilation short.
  """
  split = jax.vmap(jax.random.split) if chain.ndim == 2 else jax.random.split

  def advance(current, _):
    children = split(current)  # [..., 2 (next chain, step key), 2]
    next_chain = children[..., 0, :]
    return next_chain, (children[..., 1, :], next_chain)

  last_chain, (step_keys, chains) = jax.lax.scan(advance, chain, length=num_steps)
  return [step_keys[i] for i in range(num_steps)], chains, last_chain


@jax.jit
def _chain_at(chains, index):
  return chains[index]


class PendingChainKey(devices.DeferredHostValue):
  """The chain key after one step, not yet taken out of its dispatch's stacked keys.

  The loop records one per step as `state.train_step_rng`, but only a
  checkpoint reads it: making each its own array would cost every step an
  output array. `resolve` makes the device array (one dispatch), when the
  key is read; a checkpoint's save worker takes it with `to_host`, which
  costs the training thread nothing. The stacked keys are never donated.
  """

  __slots__ = ("_chains", "_index")

  def __init__(self, chains, index: int):
    self._chains = chains
    self._index = index

  def resolve(self) -> jax.Array:
    return _chain_at(self._chains, self._index)

  def to_host(self) -> np.ndarray:
    return np.asarray(jax.device_get(self._chains))[self._index]


def compile_ahead(random_seed: int, mode: str, train_stream: bool) -> None:
  """Compiles the run's key functions by using them once; for a background thread.

  Start-up otherwise waits for these compilations after the experiment is
  built; run beside the experiment's construction, they overlap with it.
  """
  keys = seeded_run_keys(random_seed, mode, train_stream=train_stream)
  _, _, chain = StepInputs(0, keys).next()
  jax.block_until_ready(chain.resolve())


def step_counter(global_step: int, like):
  """`global_step` placed as `evaluate` receives it: per device (pmap) or one, replicated
  (mesh). Training steps get it as a host value instead (`StepInputs`).

  `like` is a key of the run's placement (per-device keys have two axes).
  """
  if like.ndim == 2:
    return devices.put_per_device(np.full((like.shape[0],), global_step, np.int32))
  return jax.device_put(np.int32(global_step), like.sharding)


class StepInputs:
  """Hands each training step its `global_step` and `rng`, placed for the run.

  Computes `STEPS_PER_DISPATCH` steps' keys per device dispatch, so the loop
  does not pay a dispatch per step for bookkeeping. The global step is a
  host value: in pmap mode a read-only `int32[local devices]` array, in mesh
  mode an `int32` scalar. jaxline passed a NumPy array too (at the first
  step); published experiments read it with `global_step[0]` or
  `utils.get_first`, which on a device array would gather it across devices
  (~0.5 ms), while a pmap or jit that takes it pays ~7 us for the transfer.
  """

  def __init__(self, global_step: int, chain):
    self._next_step = global_step
    self._chain = chain
    self._ready = []

  def next(self):
    """Returns `(global_step, step_rng, next_chain)` for the next step.

    `next_chain` is a `PendingChainKey`.
    """
    if not self._ready:
      step_keys, chains, self._chain = _advance_steps(self._chain,
                                                      num_steps=STEPS_PER_DISPATCH)
      steps = np.arange(self._next_step, self._next_step + STEPS_PER_DISPATCH, dtype=np.int32)
      if self._chain.ndim == 2:  # pmap mode: one row per device.
        steps = np.repeat(steps[:, None], self._chain.shape[0], axis=1)
        steps.flags.writeable = False
      self._next_step += STEPS_PER_DISPATCH
      self._ready = [(step, key, PendingChainKey(chains, index))
                     for index, (step, key) in enumerate(zip(steps, step_keys))]
      self._ready.reverse()
    return self._ready.pop()
