"""Random modes: which hosts and devices share keys."""

import jax
import numpy as np
import pytest

from jaxline_ng import rng


def keys_for(mode, process_index, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: process_index)
  return np.asarray(rng.per_device_keys(rng.seed_key(0), mode))


@pytest.mark.parametrize("mode,hosts_differ,devices_differ", [
    ("unique_host_unique_device", True, True),
    ("unique_host_same_device", True, False),
    ("same_host_unique_device", False, True),
    ("same_host_same_device", False, False),
])
def test_random_mode_relations(monkeypatch, mode, hosts_differ, devices_differ):
  host0, host1 = keys_for(mode, 0, monkeypatch), keys_for(mode, 1, monkeypatch)
  num_devices = jax.local_device_count()
  assert host0.shape == (num_devices, 2) and host0.dtype == np.uint32
  assert len({tuple(k) for k in host0}) == (num_devices if devices_differ else 1)
  assert (not np.array_equal(host0, host1)) == hosts_differ
  if hosts_differ:  # No key shared between hosts at all.
    assert not {tuple(k) for k in host0} & {tuple(k) for k in host1}


def test_unknown_mode_is_rejected_with_its_name():
  with pytest.raises(ValueError, match="'unique_everything'"):
    rng.per_device_keys(rng.seed_key(0), "unique_everything")


def test_specialize_inside_pmap_matches_jaxline_contract():
  mode = "same_host_unique_device"
  specialize = jax.pmap(
      lambda key, host: rng.specialize_rng_host_device(key, host, "i", mode), axis_name="i")
  num_devices = jax.local_device_count()
  keys = np.broadcast_to(np.asarray(rng.seed_key(3)), (num_devices, 2))
  assert rng.host_id_devices_for_rng(mode) is None
  out = np.asarray(specialize(keys, np.zeros(num_devices, np.int32)))
  assert len({tuple(k) for k in out}) == num_devices
  hosts = rng.host_id_devices_for_rng("unique_host_same_device")
  np.testing.assert_array_equal(hosts, np.zeros(num_devices))


def test_step_inputs_chain_is_independent_of_block_boundaries():
  """Resuming mid-block from a chain key continues the same sequence."""
  start = rng.per_device_keys(rng.seed_key(1), "unique_host_unique_device")
  stream = rng.StepInputs(0, start)
  run = [stream.next() for _ in range(2 * rng.STEPS_PER_DISPATCH + 5)]
  resume_at = 7
  resumed = rng.StepInputs(resume_at, run[resume_at - 1][2].resolve())
  for offset in range(rng.STEPS_PER_DISPATCH):
    steps, key, chain = resumed.next()
    expected_steps, expected_key, expected_chain = run[resume_at + offset]
    np.testing.assert_array_equal(steps, expected_steps)
    np.testing.assert_array_equal(key, expected_key)
    np.testing.assert_array_equal(chain.resolve(), expected_chain.resolve())


def test_step_key_is_not_the_next_chain_key():
  stream = rng.StepInputs(0, rng.per_device_keys(rng.seed_key(1), "same_host_same_device"))
  _, key, chain = stream.next()
  assert not np.array_equal(key, chain.resolve())
  _, next_key, _ = stream.next()
  # What a step derives by splitting its key never becomes a later step's key.
  children = np.asarray(jax.vmap(jax.random.split)(key))
  for child in (children[:, 0], children[:, 1]):
    assert not np.array_equal(child, next_key)


def test_seeded_keys_equal_the_step_by_step_derivation():
  for mode in rng.RANDOM_MODES:
    for train_stream in (False, True):
      key = rng.train_chain_key(7, legacy_random_seed_behavior=not train_stream)
      np.testing.assert_array_equal(
          rng.seeded_run_keys(7, mode, train_stream=train_stream),
          rng.per_device_keys(key, mode))


def test_pending_chain_key_to_host_equals_resolve():
  stream = rng.StepInputs(0, rng.per_device_keys(rng.seed_key(2), "unique_host_unique_device"))
  pending = [stream.next()[2] for _ in range(3)]
  for chain in pending:
    host = chain.to_host()
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, np.asarray(chain.resolve()))
