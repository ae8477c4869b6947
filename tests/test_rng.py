"""Random keys: jaxline's streams, the random modes, and resuming the chain."""

import functools

import jax
import numpy as np
import pytest

from jaxline_ng import devices, mesh, rng


def chain_of(seed):
  return devices.bcast_local_devices(jax.random.PRNGKey(seed))


def step_keys(mode, process_index, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: process_index)
  step_rng, _ = rng.StepKeys(mode).next(chain_of(0))
  return np.asarray(step_rng)


@pytest.mark.parametrize("mode,hosts_differ,devices_differ", [
    ("unique_host_unique_device", True, True),
    ("unique_host_same_device", True, False),
    ("same_host_unique_device", False, True),
    ("same_host_same_device", False, False),
])
def test_random_mode_relations(monkeypatch, mode, hosts_differ, devices_differ):
  host0, host1 = step_keys(mode, 0, monkeypatch), step_keys(mode, 1, monkeypatch)
  num_devices = jax.local_device_count()
  assert host0.shape == (num_devices, 2) and host0.dtype == np.uint32
  assert len({tuple(k) for k in host0}) == (num_devices if devices_differ else 1)
  assert (not np.array_equal(host0, host1)) == hosts_differ
  if hosts_differ:  # No key shared between hosts at all.
    assert not {tuple(k) for k in host0} & {tuple(k) for k in host1}


def test_unknown_mode_is_rejected_with_its_name():
  with pytest.raises(ValueError, match="'unique_everything'"):
    rng.StepKeys("unique_everything").next(chain_of(0))
  with pytest.raises(ValueError, match="'unique_everything'"):  # As jaxline's enum refused it.
    rng.host_id_devices_for_rng("unique_everything")
  with pytest.raises(ValueError, match="random_mode_eval='unique_everything'"):
    rng.eval_keys(0, "unique_everything")


def test_seed_keys_are_jaxlines():
  key = jax.random.PRNGKey(5)
  train_key, init_key = rng.seed_keys(5, legacy_random_seed_behavior=False)
  np.testing.assert_array_equal(np.stack([train_key, init_key]), jax.random.split(key))
  train_key, init_key = rng.seed_keys(5, legacy_random_seed_behavior=True)
  np.testing.assert_array_equal(np.stack([train_key, init_key]), np.stack([key, key]))


@pytest.mark.parametrize("mode", rng.RANDOM_MODES)
def test_step_keys_are_those_of_jaxlines_per_step_pmap(mode):
  """Each step: split the replicated chain, keep [1], specialise [0] in a pmap."""
  host_ids = rng.host_id_devices_for_rng(mode)

  @functools.partial(jax.pmap, axis_name="i")
  def jaxline_step(chain, host_id):
    step_key, next_chain = tuple(jax.random.split(chain))
    return rng.specialize_rng_host_device(step_key, host_id, "i", mode), next_chain

  chain = expected_chain = chain_of(3)
  keys = rng.StepKeys(mode)
  for _ in range(5):
    step_rng, chain = keys.next(chain)
    expected_rng, expected_chain = jaxline_step(
        expected_chain, host_ids if host_ids is not None else np.zeros(len(step_rng), np.int32))
    np.testing.assert_array_equal(step_rng, expected_rng)
    np.testing.assert_array_equal(chain, expected_chain)


def test_resuming_from_a_saved_chain_continues_the_same_keys():
  mode = "unique_host_unique_device"
  chain, keys, saved, stream = chain_of(1), [], None, rng.StepKeys(mode)
  for step in range(40):
    step_rng, chain = stream.next(chain)
    keys.append(np.asarray(step_rng))
    if step == 2:
      saved = np.asarray(chain)  # What a checkpoint after step 3 holds.
  resumed, stream = rng.place_chain(saved), rng.StepKeys(mode)
  for step in range(3, 40):
    step_rng, resumed = stream.next(resumed)
    np.testing.assert_array_equal(step_rng, keys[step])


def test_keys_follow_a_chain_set_from_outside():
  stream = rng.StepKeys("same_host_unique_device")
  first_rng, _ = stream.next(chain_of(5))
  stream.next(chain_of(6))  # e.g. a restore replaced state.train_step_rng
  again_rng, _ = stream.next(chain_of(5))
  np.testing.assert_array_equal(again_rng, first_rng)


def test_step_keys_are_ready_arrays_with_one_row_per_device():
  step_rng, chain = rng.StepKeys("unique_host_unique_device").next(chain_of(2))
  for array in (step_rng, chain):
    assert isinstance(array, jax.Array)
    assert [shard.data.shape for shard in array.addressable_shards] == \
        [(1, 2)] * jax.local_device_count()


def test_a_replicated_chain_resumes_on_another_device_count():
  num_devices = jax.local_device_count()
  key = np.asarray(jax.random.PRNGKey(4))
  for saved_devices in (1, 2, num_devices + 3):
    placed = rng.place_chain(np.broadcast_to(key, (saved_devices, 2)))
    assert placed.shape == (num_devices, 2)
    np.testing.assert_array_equal(placed, np.broadcast_to(key, (num_devices, 2)))


def test_per_device_chains_refuse_another_device_count_naming_both():
  rows = np.arange(2 * 7, dtype=np.uint32).reshape(7, 2)
  with pytest.raises(ValueError, match="7 different per-device keys.*7 local devices"):
    rng.place_chain(rows)


def test_step_key_is_not_the_next_chain_key():
  stream = rng.StepKeys("same_host_same_device")
  step_rng, chain = stream.next(chain_of(1))
  next_rng, _ = stream.next(chain)
  assert not np.array_equal(step_rng, chain)
  # What a step derives by splitting its key never becomes a later step's key.
  children = np.asarray(jax.vmap(jax.random.split)(step_rng))
  for child in (children[:, 0], children[:, 1]):
    assert not np.array_equal(child, next_rng)


def test_eval_keys_are_the_seeds_key_specialised():
  keys = np.asarray(rng.eval_keys(9, "same_host_same_device"))
  np.testing.assert_array_equal(
      keys, np.broadcast_to(jax.random.PRNGKey(9), (jax.local_device_count(), 2)))
  assert len({tuple(k) for k in np.asarray(rng.eval_keys(9, "same_host_unique_device"))}) == \
      jax.local_device_count()


def test_step_counter_is_a_host_array_per_device():
  steps = mesh.placement().step_counter(12)
  assert isinstance(steps, np.ndarray) and steps.shape == (jax.local_device_count(),)
  assert (steps == 12).all()
  # `evaluate` gets them on the devices, one row each, as jaxline's bcast_local_devices.
  on_devices = mesh.placement().step_counter(12, on_devices=True)
  assert devices.one_row_per_device(on_devices) and (np.asarray(on_devices) == 12).all()


@pytest.mark.parametrize("mode", ["unique_host_unique_device", "same_host_same_device"])
def test_typed_keys_give_the_same_stream_as_raw_ones(mode):
  """A typed chain (`jax_enable_custom_prng`, `jax.random.key`) yields typed
  step keys with the raw chain's data, and restores typed or raw as the run's is."""
  raw, typed = chain_of(3), devices.bcast_local_devices(jax.random.wrap_key_data(
      jax.random.PRNGKey(3)))
  raw_keys, typed_keys = rng.StepKeys(mode), rng.StepKeys(mode)
  for _ in range(3):
    raw_rng, raw = raw_keys.next(raw)
    typed_rng, typed = typed_keys.next(typed)
    assert devices.is_typed_key(typed_rng) and typed_rng.shape == (jax.local_device_count(),)
    np.testing.assert_array_equal(jax.random.key_data(typed_rng), raw_rng)
    np.testing.assert_array_equal(jax.random.key_data(typed), raw)
  assert devices.is_typed_key(rng.place_chain(np.asarray(raw), like=typed))
  np.testing.assert_array_equal(rng.place_chain(typed, like=raw), raw)
  with jax.enable_custom_prng(True):
    eval_keys = rng.eval_keys(9, mode)
  assert devices.is_typed_key(eval_keys)
  np.testing.assert_array_equal(jax.random.key_data(eval_keys), rng.eval_keys(9, mode))
