"""Replication onto local devices and reading the first copy back."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxline_ng import devices, utils


def test_bcast_then_get_first_round_trips_a_pytree():
  tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(2.0), "n": None}
  replicated = utils.bcast_local_devices(tree)
  num_devices = jax.local_device_count()
  assert replicated["w"].shape == (num_devices, 2, 3)
  assert len(replicated["w"].addressable_shards) == num_devices
  first = utils.get_first(replicated)
  np.testing.assert_array_equal(first["w"], tree["w"])
  assert float(first["b"]) == 2.0 and first["n"] is None


def test_get_first_reads_one_shard_and_survives_donation():
  double = jax.pmap(lambda x: x * 2, axis_name="i", donate_argnums=0)
  x = double(utils.bcast_local_devices(jnp.ones(3)))
  first = utils.get_first(x)
  # The first copy lives on one device only: no gather happened.
  assert len(first.devices()) == 1
  double(x)  # Donates (deletes) x's buffers.
  np.testing.assert_array_equal(first, np.full(3, 2.0))


def test_get_first_on_numpy_indexes_like_jaxline():
  assert utils.get_first(np.array([5, 6])) == 5


def test_replicated_state_feeds_pmap_without_recompiling():
  traces = []

  def add(x):
    traces.append(1)
    return x + 1

  step = jax.pmap(add, axis_name="i")
  x = utils.bcast_local_devices(jnp.zeros(2))
  for _ in range(3):
    x = step(x)
  assert len(traces) == 1
  assert x.sharding == devices.bcast_local_devices(jnp.zeros(2)).sharding


def test_tree_psum_inside_pmap():
  total = jax.pmap(lambda t: utils.tree_psum(t, "i"), axis_name="i")(
      utils.bcast_local_devices({"a": jnp.ones(())}))
  assert float(utils.get_first(total)["a"]) == jax.local_device_count()
