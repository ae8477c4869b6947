"""utils keeps every public jaxline name, and importing jaxline_ng stays light."""

import ast
import os
import subprocess
import sys
import threading
import time
from unittest import mock

import jax
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from ml_collections import config_dict

import jaxline_ng
from jaxline_ng import utils

JAXLINE_UTILS_NAMES = (
    "get_first", "bcast_local_devices", "py_prefetch", "double_buffer", "double_buffer_on_gpu",
    "make_async", "specialize_rng_host_device", "host_id_devices_for_rng", "rendezvous",
    "kwargs_only", "log_activity", "PeriodicAction", "InMemoryCheckpointer", "Writer",
    "Checkpointer", "disable_pmap_jit", "debugger_fallback", "evaluate_should_return_dict",
    "tree_psum", "GLOBAL_CHECKPOINT_DICT", "SnapshotNT", "CheckpointNT", "get_checkpoint_dir",
    "DistributedRNGMode", "maybe_device_get")


@pytest.mark.parametrize("name", JAXLINE_UTILS_NAMES)
def test_name_is_public(name):
  assert hasattr(utils, name)


def test_importing_the_platform_does_not_import_tensorflow():
  code = ("import sys; from jaxline_ng import platform, utils, train; "
          "print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


def test_py_prefetch_yields_in_order_and_reraises():
  assert list(utils.py_prefetch(lambda: iter(range(20)), buffer_size=3)) == list(range(20))

  def broken():
    yield 1
    raise ValueError("bad batch")

  batches = utils.py_prefetch(broken)
  assert next(batches) == 1
  with pytest.raises(ValueError, match="bad batch"):
    next(batches)


def test_py_prefetch_counts_the_element_in_use_as_jaxline_does():
  produced = []

  def numbers():
    for i in range(10):
      produced.append(i)
      yield i

  batches = utils.py_prefetch(numbers, buffer_size=3)
  assert next(batches) == 0
  deadline = time.monotonic() + 10
  while len(produced) < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.1)  # A producer allowed further would show it by now.
  # The element in use and 2 queued; the producer holds the next one, waiting to queue it.
  assert produced == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="buffer_size=1 must be > 1"):
    next(utils.py_prefetch(numbers, buffer_size=1))


PRODUCER_IN_JAXLIB_AT_EXIT = """
import jax
from ml_collections import config_dict

import jaxline_ng
from jaxline_ng import utils

def batches():  # Each item is made inside jaxlib's native pytree code.
  leaves = list(range(2000))
  while True:
    yield jax.tree.map(lambda x: x + 1, leaves)

it = utils.py_prefetch(batches, buffer_size=10**6)
next(it)
raise RuntimeError("the step fails while the producer runs")
"""


def test_a_run_failing_while_its_producer_runs_exits_with_its_own_code():
  # The producer, a daemon thread inside jaxlib as the interpreter ended,
  # aborted the process (exit 134, "FATAL: exception not rethrown") in 3 runs of 4.
  for _ in range(2):
    result = subprocess.run([sys.executable, "-c", PRODUCER_IN_JAXLIB_AT_EXIT],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.rstrip().endswith(
        "RuntimeError: the step fails while the producer runs"), result.stderr[-2000:]


def test_double_buffer_on_gpu_hands_back_the_dataset_itself_elsewhere():
  batches = [1, 2]
  assert utils.double_buffer_on_gpu(batches) is batches


def test_double_buffer_places_batches_per_device():
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  n = jax.local_device_count()
  batches = [np.full((n, 2), i, np.float32) for i in range(3)]
  placed = list(utils.double_buffer(batches))
  assert [float(utils.get_first(b)[0]) for b in placed] == [0.0, 1.0, 2.0]
  assert all(len(b.addressable_shards) == n for b in placed)


def test_kwargs_only_rejects_positional_calls():
  f = utils.kwargs_only(lambda a: a)
  assert f(a=1) == 1
  with pytest.raises(TypeError):
    f(1)  # pylint: disable=too-many-function-args


def test_distributed_rng_mode_is_jaxlines_enum():
  mode = utils.DistributedRNGMode("unique_host_same_device")
  assert mode.unique_host and not mode.unique_device
  assert utils.DistributedRNGMode.SAME_HOST_UNIQUE_DEVICE.unique_device
  with pytest.raises(ValueError):
    utils.DistributedRNGMode("unique_everything")


# Calls as jaxline 0.0.8's signatures allow them: its keyword-only
# `thread_name`, `mode`'s default, its parameter names, `log_activity` as a decorator.
def test_py_prefetch_names_its_thread_with_jaxlines_keyword():
  names = []

  def numbers():
    names.append(threading.current_thread().name)
    yield from range(3)

  assert list(utils.py_prefetch(numbers, thread_name="input")) == [0, 1, 2]
  assert names == ["input"]


def test_specialize_rng_host_device_defaults_to_unique_host_unique_device():
  keys = utils.bcast_local_devices(jax.random.PRNGKey(0))
  host_ids = utils.host_id_devices_for_rng()

  def specialize(*mode):
    return jax.pmap(lambda key, host: utils.specialize_rng_host_device(key, host, "i", *mode),
                    axis_name="i")(keys, host_ids)

  np.testing.assert_array_equal(specialize(), specialize("unique_host_unique_device"))


def test_parameters_keep_jaxlines_names():
  assert utils.get_first(xs=np.arange(3)) == 0
  assert utils.kwargs_only(f=lambda **kw: kw)(a=1) == {"a": 1}
  assert utils.evaluate_should_return_dict(f=lambda: None)() == {}
  assert utils.debugger_fallback(f=lambda: 2)() == 2


def test_log_activity_logs_jaxlines_lines():
  # As jaxline's own tests check them, patching through `utils.logging`.
  with mock.patch("jaxline_ng.utils.logging.info") as info, \
      mock.patch("jaxline_ng.utils.logging.exception") as exception:
    with utils.log_activity("for test"):
      pass
    with pytest.raises(ValueError, match="Intentional"):
      with utils.log_activity("for test"):
        raise ValueError("Intentional")
  assert info.call_args_list == [mock.call("[jaxline] %s starting...", "for test"),
                                 mock.call("[jaxline] %s finished.", "for test"),
                                 mock.call("[jaxline] %s starting...", "for test")]
  exception.assert_called_once_with("[jaxline] %s failed with error.", "for test")


def test_tests_written_for_jaxline_patch_jax_and_chex_through_utils():
  with mock.patch.object(utils.jax, "process_index", return_value=3):
    assert utils.host_id_devices_for_rng("unique_host_same_device")[0] == 3
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with mock.patch.object(utils.chex, "fake_pmap_and_jit", autospec=True) as fake, \
      flagsaver.flagsaver(jaxline_disable_pmap_jit=True):
    assert utils.disable_pmap_jit(lambda: 5)() == 5
  fake.assert_called_once()


def test_log_activity_is_also_a_decorator(caplog):
  @utils.log_activity("counting")
  def count(n):
    if n < 0:
      raise ValueError("negative")
    return n + 1

  with caplog.at_level("INFO", logger="absl"):
    assert count(1) == 2
    with pytest.raises(ValueError, match="negative"):
      count(-1)
  assert caplog.text.count("counting starting...") == 2
  assert "counting finished" in caplog.text and "counting failed" in caplog.text


def test_an_evaluate_returning_none_is_warned_about_once_as_in_jaxline():
  evaluate = utils.evaluate_should_return_dict(lambda: None)
  with mock.patch.object(utils.logging, "warning") as warning, \
      mock.patch.object(utils.logging, "log") as log:
    for _ in range(3):
      assert evaluate() == {}
  # Once per process: an earlier test in this process may have had the warning.
  assert warning.call_count + log.call_count <= 1


def test_a_checkpoint_dict_rebound_through_utils_is_the_one_the_checkpointer_uses():
  # jaxline's own tests rebind it in setUp; others patch it for one test.
  checkpointer = utils.InMemoryCheckpointer(
      config_dict.ConfigDict({"max_checkpoints_to_keep": 1}), "train")
  mine = {}
  utils.GLOBAL_CHECKPOINT_DICT = mine
  checkpointer.get_experiment_state("latest").global_step = 3
  checkpointer.save("latest")
  assert mine["latest"].history[-1].pickle_nest.global_step == 3
  with mock.patch.object(utils, "GLOBAL_CHECKPOINT_DICT", {}):
    assert not checkpointer.can_be_restored("latest")
  assert checkpointer.can_be_restored("latest") and utils.GLOBAL_CHECKPOINT_DICT is mine


def test_no_module_of_the_package_imports_one_that_imports_it_back():
  package = os.path.dirname(jaxline_ng.__file__)
  imports = {}
  for file in os.listdir(package):
    if file.endswith(".py") and file != "__init__.py":
      with open(os.path.join(package, file)) as source:
        tree = ast.parse(source.read())
      imports[file[:-3]] = {
          name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
          for name in ([node.module.split(".")[1]] if node.module.startswith("jaxline_ng.")
                       else [alias.name for alias in node.names] if node.module == "jaxline_ng"
                       else [])}

  def reaches(start, goal, seen):
    return any(module == goal or (module not in seen and module in imports
                                  and reaches(module, goal, seen | {module}))
               for module in imports[start])

  assert sorted(module for module in imports if reaches(module, module, {module})) == []
