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


def test_packed_first_holds_the_first_copy_in_one_buffer_per_width():
  """Numbers of one width share a buffer (bit-cast, values kept exactly);
  bools get their own."""
  tree = {"w": jnp.arange(6.0).reshape(2, 3) - 2.5, "b": jnp.full(3, jnp.nan),
          "count": jnp.int32(-7), "nested": (jnp.full((2, 2), 1.5, jnp.bfloat16),),
          "mask": jnp.array([True, False]), "steps": jnp.uint16(9)}
  replicated = devices.bcast_local_devices(tree)
  assert devices.PackedFirst.can_pack(replicated)
  assert not devices.PackedFirst.can_pack({"host": np.ones((jax.local_device_count(), 2))})
  packed = devices.PackedFirst.pack(replicated)
  assert len(packed.buffers) == 3  # 32-bit, 16-bit, bool
  host = devices.to_host({"experiment_module": {"params": packed}})["experiment_module"]["params"]
  expected = jax.device_get(devices.get_first(replicated))
  jax.tree.map(np.testing.assert_array_equal, host, expected)
  assert jax.tree.map(lambda x: x.dtype, host) == jax.tree.map(lambda x: x.dtype, expected)
  assert host["nested"][0].dtype == jnp.bfloat16


def test_packed_first_is_the_first_devices_copy_and_only_it_copies():
  """Replicas that differ (a pmap with its own axis name made them) pack as
  the first device's, as `get_first` reads them; the other devices' rows
  hold zeros, not copies."""
  count = jax.local_device_count()
  per_device = jax.pmap(lambda x: {"w": x * 2.0, "n": (x[0] + 1).astype(jnp.int32)},
                        axis_name="batch")(
      devices.put_per_device(np.arange(count * 3, dtype=np.float32).reshape(count, 3) + 1))
  packed = devices.PackedFirst.pack(per_device)
  host = packed.to_host()
  jax.tree.map(np.testing.assert_array_equal, host,
               jax.device_get(devices.get_first(per_device)))
  for buffer in packed.buffers:
    for position in range(1, count):
      assert not np.asarray(buffer.addressable_data(position)).any()


def test_packed_first_packs_across_axis_names_but_not_device_orders():
  """A pmap's outputs (mesh axis "batch") and `put_per_device` arrays (axis "i")
  pack together; arrays whose rows go to the devices in another order are
  read with `get_first` instead."""
  count = jax.local_device_count()
  on_i = devices.put_per_device(np.ones((count, 2), np.float32))
  on_batch = jax.pmap(lambda x: x + 1, axis_name="batch")(on_i)
  reversed_mesh = jax.sharding.Mesh(np.array(jax.local_devices()[::-1]), ("r",))
  on_reversed = jax.device_put(np.arange(count, dtype=np.float32)[:, None],
                               jax.sharding.NamedSharding(reversed_mesh, jax.sharding.PartitionSpec("r")))
  assert devices.PackedFirst.can_pack({"a": on_i, "b": on_batch})
  host = devices.to_host(devices.packed_first({"a": on_i, "b": on_batch}))
  np.testing.assert_array_equal(host["b"], np.full(2, 2.0))
  assert not devices.PackedFirst.can_pack({"a": on_i, "r": on_reversed})
  first = jax.device_get(devices.packed_first({"a": on_i, "r": on_reversed}))
  np.testing.assert_array_equal(first["r"], [0.0])


def test_staged_read_matches_reading_each_step_apart():
  """Stacked chunks (64 and 16 steps), leftovers, host leaves and a changed
  structure all give what `device_get(first_shards(...))` gives."""
  per_step = jax.pmap(lambda x: {"loss": jax.lax.pmean(x, "i"), "per_device": x},
                      axis_name="i")
  base = devices.put_per_device(np.arange(jax.local_device_count(), dtype=np.float32))
  trees = [dict(per_step(base + step), host=step, replicated=jnp.float32(step))
           for step in range(83)]
  mixed = trees[:3] + [{"loss": trees[0]["loss"]}]  # Another structure: read apart.
  for batch in (trees, mixed):
    expected = jax.device_get(devices.first_shards(batch))
    got = devices.stage_first_shards_read(batch)()
    assert len(got) == len(expected)
    for got_tree, expected_tree in zip(got, expected):
      assert got_tree.keys() == expected_tree.keys()
      for name in got_tree:
        np.testing.assert_array_equal(np.asarray(got_tree[name]),
                                      np.asarray(expected_tree[name]))
        assert np.shape(got_tree[name]) == np.shape(expected_tree[name])
