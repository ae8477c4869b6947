"""Replication onto local devices and reading the first copy back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize("value, dtype", [
    (jnp.float32(0.5), "float32"),  # A step ported to mesh mode: `utils.get_first(loss)`.
    (np.int32(3), "int32"),  # Code written for pmap run in mesh mode: `get_first(global_step)`.
])
def test_get_first_of_a_0d_value_names_the_missing_device_axis(value, dtype):
  with pytest.raises(ValueError, match=f"get_first: a 0-d {dtype} value has no device axis"):
    utils.get_first({"x": value})


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


def test_tree_psum_takes_psums_arguments_as_jaxlines_did():
  """jaxline's `tree_psum` is `jax.lax.psum`: keywords and `axis_index_groups` work."""
  n = jax.local_device_count()
  total = jax.pmap(lambda t: utils.tree_psum(x=t, axis_name="i", axis_index_groups=None),
                   axis_name="i")(utils.bcast_local_devices({"a": jnp.ones(())}))
  assert float(utils.get_first(total)["a"]) == n


_add = jax.pmap(lambda x, k: x + k, axis_name="i", in_axes=(0, None))


def _per_device_values(k):
  """A pmap output holding a different value on each device: k, k + 1, ..."""
  return _add(jnp.arange(jax.local_device_count(), dtype=jnp.float32), jnp.float32(k))


def test_first_copies_to_host_read_one_copy_of_each_array_of_each_tree():
  mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # 37 steps: stacked in groups padded to powers of two, the last group partial.
  trees = [{"per_device": _per_device_values(k),
            "replicated": jax.device_put(jnp.float32(k), replicated),
            "single": jax.device_put(jnp.int32(k), jax.local_devices()[0]),
            "host": float(k), "text": "x"} for k in range(37)]
  got = devices.first_copies_to_host(trees)
  assert len(got) == len(trees)
  for k, tree in enumerate(got):
    # A per-device array keeps its leading axis; the first device holds k.
    np.testing.assert_array_equal(tree["per_device"], np.array([k], np.float32))
    assert np.asarray(tree["replicated"]).shape == () and tree["replicated"] == k
    assert tree["single"] == k and np.asarray(tree["single"]).dtype == np.int32
    assert tree["host"] == float(k) and tree["text"] == "x"
    assert not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))


def test_first_copies_to_host_split_large_groups_and_read_other_arrays_whole():
  n = jax.local_device_count()
  sharded_rows = jax.device_put(jnp.arange(2 * n, dtype=jnp.float32).reshape(2 * n),
                                devices.per_device_sharding())
  trees = [{"loss": _per_device_values(k)} for k in range(300)] + [{"rows": sharded_rows}]
  got = devices.first_copies_to_host(trees)
  assert [float(tree["loss"][0]) for tree in got[:300]] == list(range(300))
  # Two rows per device hold no single copy: the whole array is read.
  np.testing.assert_array_equal(got[300]["rows"], np.arange(2 * n))


def test_first_copies_to_host_read_many_arrays_of_one_placement_in_one_transfer(monkeypatch):
  stacks, single_reads = [], []
  stacker, read_first_copy = devices._stacker, devices._read_first_copy  # pylint: disable=protected-access

  def counted_stacker(sharding):
    return lambda arrays: stacks.append(len(arrays)) or stacker(sharding)(arrays)

  monkeypatch.setattr(devices, "_stacker", counted_stacker)
  monkeypatch.setattr(devices, "_read_first_copy",
                      lambda leaf: single_reads.append(leaf) or read_first_copy(leaf))
  got = devices.first_copies_to_host([{"loss": _per_device_values(k)} for k in range(64)])
  assert [float(tree["loss"][0]) for tree in got] == list(range(64))
  assert stacks == [64] and not single_reads


def test_get_first_is_the_first_row_however_the_array_is_sharded():
  """jaxline's `get_first` is `x[0]`. Reading the first device's shard gave part
  of the row (an array split along a later axis, such as a mesh's model axis)
  or another row (a mesh whose devices come in another order)."""
  cpus = np.array(jax.devices())
  layouts = {
      "columns": (Mesh(cpus, ("d",)), P(None, "d"), (2, 8)),
      "rows, devices reversed": (Mesh(cpus[::-1], ("d",)), P("d"), (4, 3)),
      "data x model": (Mesh(cpus.reshape(2, 2), ("data", "model")), P("data", "model"), (4, 6)),
  }
  for name, (mesh, spec, shape) in layouts.items():
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x = jax.device_put(value, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(utils.get_first(x), value[0], err_msg=name)
  # Logging reads the first device's value of per-device scalars, one array or
  # several at once, whatever order the mesh lists the devices in.
  scalars = jax.device_put(np.arange(4.0), NamedSharding(Mesh(cpus[::-1], ("d",)), P("d")))
  assert float(devices.first_copy_to_host(scalars)[0]) == 0.0
  assert [float(read[0]) for read in devices.first_copies_to_host([scalars] * 5)] == [0.0] * 5


def test_restored_like_gives_restored_keys_the_kind_the_live_value_has():
  """A checkpoint of code that used typed keys resumes code that uses raw ones, and back."""
  typed, raw = jax.random.key(3), jax.random.PRNGKey(3)
  as_raw = devices.restored_like({"k": raw}, {"k": typed})["k"]
  assert not devices.is_typed_key(as_raw)
  np.testing.assert_array_equal(as_raw, raw)
  as_typed = devices.restored_like({"k": typed}, {"k": np.asarray(raw)})["k"]
  assert devices.is_typed_key(as_typed)
  assert devices.restored_like(None, {"k": typed})["k"] is typed  # Built by the first step.


def test_restored_like_puts_host_arrays_back_where_the_live_ones_are():
  """A disk restore reads to NumPy; the experiment had device arrays."""
  uncommitted, pinned = jnp.zeros(2), jax.device_put(jnp.zeros(2), jax.devices()[1])
  per_device = jax.pmap(lambda x: x)(jnp.zeros((jax.local_device_count(), 2)))
  restored = devices.restored_like(
      {"u": uncommitted, "p": pinned, "d": per_device, "grown": pinned},
      {"u": np.ones(2), "p": np.ones(2), "d": np.ones(per_device.shape), "grown": np.ones(5)})
  # jit still moves an uncommitted value to the devices of what it meets.
  assert isinstance(restored["u"], jax.Array) and not restored["u"].committed
  assert restored["p"].committed and restored["p"].devices() == {jax.devices()[1]}
  assert restored["grown"].shape == (5,) and restored["grown"].devices() == {jax.devices()[1]}
  assert restored["d"].sharding == per_device.sharding
