"""Multi-process runs: real processes on loopback, started by jaxline_ng.launch.

Each case launches 2 processes x 2 fake CPU devices; the reference is one
process with 4 devices training on the same global batch.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ENV, EXPERIMENTS, TOY, devices_env, launch_command, run
from helpers import toy_command as toy

from jaxline_ng import agreement, disk_checkpointing, distributed, multihost
from jaxline_ng import launch as launch_lib


def launch(command, timeout=180, env=ENV):
  return run(launch_command(command), timeout=timeout, env=env)


def single_process(command, devices=4):
  result = run(command, timeout=180, env=devices_env(devices))
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def final_params(checkpoint_dir):
  step, nest = disk_checkpointing.read(str(checkpoint_dir))
  return step, nest["experiment_module"]["params"]


def test_two_processes_train_like_one_with_all_devices_and_resume_together(tmp_path):
  run_dir = tmp_path / "multi"
  # A compilation cache under the run's directory (the default off CPU).
  env = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  # train_checkpoint_all_hosts asks for process 1's own copies, which no
  # process would read: every process restores process 0's disk checkpoints.
  result = launch(toy(run_dir, "--config.training_steps=20",
                      "--config.train_checkpoint_all_hosts=True",
                      f"--config.compilation_cache_dir={run_dir / 'compilation_cache'}",
                      f"--config.experiment_kwargs.config.record_keys_dir={tmp_path}"), env=env)
  assert result.returncode == 0, result.stdout[-4000:]
  assert "config.train_checkpoint_all_hosts=True is ignored" in result.stdout
  single_process(toy(tmp_path / "single", "--config.training_steps=20"))
  multi_step, multi = final_params(run_dir)
  single_step, single = final_params(tmp_path / "single")
  assert multi_step == single_step == 20
  np.testing.assert_allclose(multi, single, rtol=1e-6)

  # Only process 0 wrote summaries, a run record and checkpoints (the
  # compilation cache is the run's, shared by its processes).
  assert sorted(os.listdir(run_dir)) == ["checkpoints", "compilation_cache", "train"]
  assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest"]
  assert "process_1" not in os.listdir(run_dir / "train")

  # Keys differ or match across processes and devices as each random mode says.
  keys = [np.load(tmp_path / f"keys_p{i}.npz") for i in range(2)]
  for mode, (hosts_differ, devices_differ) in {
      "unique_host_unique_device": (True, True), "unique_host_same_device": (True, False),
      "same_host_unique_device": (False, True), "same_host_same_device": (False, False)}.items():
    assert (not np.array_equal(keys[0][mode], keys[1][mode])) == hosts_differ, mode
    assert (not np.array_equal(keys[0][mode][0], keys[0][mode][1])) == devices_differ, mode
  # The loop's step keys follow random_mode_train (unique_host_unique_device).
  all_step_keys = {tuple(k) for p in keys for k in p["step"]}
  assert len(all_step_keys) == 4

  # Both processes restore the same step; with log_all_hosts both write.
  resumed = launch(toy(run_dir, "--config.training_steps=25", "--config.log_all_hosts"))
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  restored = [line for line in resumed.stdout.splitlines() if "Restored checkpoint" in line]
  assert sorted(line.split()[0] for line in restored) == ["[p0]", "[p1]"]
  assert all(line.rstrip(".").endswith(os.path.join("latest", "20")) for line in restored)
  for path in (run_dir / "train" / "metrics.jsonl",
               run_dir / "train" / "process_1" / "metrics.jsonl"):
    with open(path) as f:
      assert json.loads(f.readlines()[-1])["step"] == 25


GLOBAL_BATCH = """
import sys, threading
import jax, numpy as np
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec
from jaxline_ng import multihost
flags.FLAGS(sys.argv)
multihost.initialize_if_requested()
multihost.own_collectives()
batch = np.arange(2 * jax.device_count() * 3, dtype=np.float32).reshape(-1, 3)
for shape, spec in [((4, 1), ("data",)), ((1, 4), ("data",)), ((2, 2), ("data",)),
                    ((4, 1), ())]:
  mesh = jax.make_mesh(shape, ("data", "model"))
  expected = NamedSharding(mesh, PartitionSpec(*spec)).devices_indices_map(batch.shape)
  def check(array, how):
    right = array.shape == batch.shape and all(
        np.array_equal(np.asarray(shard.data), batch[expected[shard.device]])
        for shard in array.addressable_shards)
    print(f"mesh {shape} spec {spec}{how}: {'right' if right else 'WRONG'}", flush=True)
  check(multihost.global_batch(multihost.host_slice(batch), mesh, PartitionSpec(*spec)), "")
  def prefetch():
    try:
      check(multihost.global_batch(multihost.host_slice(batch), mesh, PartitionSpec(*spec)),
            " prefetched")
    except multihost.CollectiveThreadError as e:
      print(f"mesh {shape} spec {spec} prefetched: refused: {e}", flush=True)
    check(multihost.global_batch_from_every_row(batch, mesh, PartitionSpec(*spec)),
          " prefetched from every row")
  thread = threading.Thread(target=prefetch, name="py_prefetch")
  thread.start()
  thread.join()
# A typed key put on a mesh over both processes (a key lives on one device).
from jaxline_ng import base_config, mesh as mesh_lib
config = base_config.get_base_config()
config.placement = "mesh"
mesh_lib.activate(config)
key = mesh_lib.replicate(jax.random.key(1))
same = np.array_equal(np.asarray(jax.random.key_data(key).addressable_shards[0].data),
                      np.asarray(jax.random.key_data(jax.random.key(1))))
print(f"typed key replicated: {'right' if same and key.shape == () else 'WRONG'}", flush=True)
"""


def test_global_batch_is_every_process_rows_whatever_mesh_axis_holds_the_batch(tmp_path):
  # With data:1,model:4 over 2 processes each device holds the whole batch,
  # half of which the other process has: it was silently half a batch. The
  # gather that fills it is a collective: from a prefetch thread it met the
  # training step's collectives in another order in each process, and the
  # run hung; there it is refused by name, and every row serves instead.
  script = tmp_path / "global_batch.py"
  script.write_text(GLOBAL_BATCH)
  result = launch([sys.executable, str(script)], timeout=120)
  assert result.returncode == 0, result.stdout[-4000:]
  for process in range(2):
    for shape, spec, gathers in [((4, 1), ("data",), False), ((1, 4), ("data",), True),
                                 ((2, 2), ("data",), False), ((4, 1), (), True)]:
      for how in ("", " prefetched from every row") + (() if gathers else (" prefetched",)):
        assert f"[p{process}] mesh {shape} spec {spec}{how}: right" in result.stdout, \
            result.stdout
      refused = (f"[p{process}] mesh {shape} spec {spec} prefetched: refused: global_batch over "
                 "mesh")
      assert (refused in result.stdout) == gathers, result.stdout
    assert ("called on thread 'py_prefetch': every process must issue collectives in one order"
            in result.stdout)
    assert f"[p{process}] typed key replicated: right" in result.stdout, result.stdout


def test_a_dying_process_fails_the_launch_fast_with_its_error(tmp_path):
  result = launch(toy(tmp_path, "--config.training_steps=1000",
                      "--config.experiment_kwargs.config.fail_at_step=3",
                      "--config.experiment_kwargs.config.fail_on_process=1"), timeout=120)
  assert result.returncode != 0
  assert any(line.startswith("[p1]") and "toy experiment fails at step 3" in line
             for line in result.stdout.splitlines())
  assert "[launch] process 1 failed" in result.stdout


def test_a_launch_of_a_program_that_is_not_there_is_one_line(capsys):
  with pytest.raises(SystemExit) as exited:
    launch_lib.main(["--", "/nonexistent/python", "x.py"])
  assert exited.value.code == 2
  assert "'/nonexistent/python' is not found" in capsys.readouterr().err


@pytest.mark.parametrize("port, culprit", [
    (99999, "--port=99999 is not a port (1-65535, or 0 to pick a free one)"),
    (None, "is in use on this host (another run's coordinator?)")])
def test_a_launch_on_a_port_it_cannot_have_starts_nothing(capsys, port, culprit):
  # A process given a live run's coordinator port aborted that whole run.
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    with pytest.raises(SystemExit) as exited:
      launch_lib.main([f"--port={port or held.getsockname()[1]}", "--", sys.executable, "x.py"])
  assert exited.value.code == 2
  assert culprit in capsys.readouterr().err


def test_processes_launched_with_other_jax_settings_or_the_debug_switch_stop_naming_it(tmp_path):
  # x64 on one process aborted both in a collective, naming nothing; under the
  # debug switch each process trained alone, then hung in the first save.
  command = " ".join(toy(tmp_path / "x64", "--config.training_steps=4"))
  result = launch(["sh", "-c", f"JAX_ENABLE_X64=$JAX_PROCESS_ID exec {command}"], timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 was launched unlike process 0: jax_enable_x64=True "
          "(process 0: False)") in result.stdout, result.stdout[-4000:]
  result = launch(toy(tmp_path / "debug", "--jaxline_disable_pmap_jit"), timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("jaxline_ng: error: --jaxline_disable_pmap_jit runs pmap as a vmap over this process's "
          "devices alone, so several processes would train apart: debug with one process"
          ) in result.stdout, result.stdout[-4000:]


def test_host_slice_takes_this_process_share(monkeypatch):
  rows = np.arange(8)
  np.testing.assert_array_equal(multihost.host_slice(rows), rows)
  monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost.jax, "process_index", lambda: 1)
  np.testing.assert_array_equal(multihost.host_slice({"x": rows})["x"], [4, 5, 6, 7])
  with pytest.raises(ValueError, match="3 rows do not split over 2 processes"):
    multihost.host_slice(np.arange(3))


def test_an_exchange_polls_and_never_lets_a_blocking_read_time_out(monkeypatch):
  # JAX's blocking read leaks ~30 KB of native memory each time it times out
  # (the peer-failure watcher renews one for a whole run); a missing key's
  # read leaks nothing.
  class Store:
    def __init__(self):
      self.reads = 0

    def key_value_try_get(self, key):
      self.reads += 1
      if key.endswith("/k/0") and self.reads >= 5:
        return "written"
      raise RuntimeError(f"NOT_FOUND: {key}")

    def blocking_key_value_get(self, key, timeout_ms):
      raise AssertionError("a blocking read that times out leaks")

  store = Store()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  assert multihost.exchange("k", None, read_from=[0]) == ["written"]
  assert store.reads >= 5


class DictStore:
  """The distributed runtime's key-value store, in one process."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value):
    if key in self.values:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.values[key] = value

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.values[key]


def test_a_peers_exception_after_a_step_does_not_veto_the_chiefs_save_of_it(monkeypatch):
  # Process 1 completed steps 1..11 (finite) and raised in step 12 before the
  # chief's save worker announced step 10: step 10 is still saved, step 12 is not.
  from jaxline_ng import guards  # pylint: disable=import-outside-toplevel
  store = DictStore()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  monkeypatch.setattr(agreement, "_ending", type(agreement._ending)())  # pylint: disable=protected-access
  monkeypatch.setattr(guards.jax, "process_count", lambda: 2)
  peer_guard = guards.NonFiniteGuard("halt")
  for step in range(1, 12):
    peer_guard(0.0, step, {"loss": np.float32(step)})
  monkeypatch.setattr(guards.jax, "process_index", lambda: 1)
  guards.PeerChecks(peer_guard).answer_before_failing()
  multihost.publish_failure("RuntimeError: fails at step 12", 1)

  monkeypatch.setattr(guards.jax, "process_index", lambda: 0)
  chief = guards.PeerChecks(guards.NonFiniteGuard("halt"))
  chief.before_save(10)()
  with pytest.raises(guards.PeerFailedError, match="process 1: RuntimeError: fails at step 12"):
    chief.before_save(12)()


def test_an_exchange_gives_up_on_a_published_failure_or_its_predicate(monkeypatch):
  # A peer that died never publishes its value: the wait for it ends on the
  # failure it published, or on the caller's own reason (a closed answerer).
  store = DictStore()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  monkeypatch.setattr(agreement, "_ending", type(agreement._ending)())  # pylint: disable=protected-access
  monkeypatch.setattr(agreement.jax, "process_count", lambda: 2)
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 0)
  started = time.monotonic()
  assert multihost.exchange("answer", "mine", give_up=lambda: time.monotonic() > started + 0.3) \
      is None
  assert multihost.exchange("answer", None, read_from=[0], give_up=lambda: True) == ["mine"]
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 1)
  multihost.publish_failure("RuntimeError: died", 1)
  assert multihost.exchange("never", None, read_from=[0]) is None
  # A value published before the failure is still read.
  assert multihost.exchange("answer", "theirs") == ["mine", "theirs"]


def record_exits_for_peer(monkeypatch) -> list[str]:
  """Failures `agreement.exit_for_peer` gets; each call raises SystemExit with the code."""
  exits = []

  def exit_for_peer(failure):
    exits.append(failure)
    raise SystemExit(int(failure.split()[1]))

  monkeypatch.setattr(agreement, "exit_for_peer", exit_for_peer)
  return exits


def test_an_eval_process_waiting_for_the_chiefs_choice_ends_on_a_published_failure(monkeypatch):
  # The chief of an eval job failed before choosing: the wait for its choice
  # ends with the chief's exit code instead of polling until the watcher does.
  from jaxline_ng import evaluation  # pylint: disable=import-outside-toplevel
  store = DictStore()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  monkeypatch.setattr(agreement, "_ending", type(agreement._ending)())  # pylint: disable=protected-access
  monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 0)
  multihost.publish_failure("OSError: disk gone", 3)
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 1)
  monkeypatch.setattr(evaluation.preemption, "stop_requested", lambda: False)
  exits = record_exits_for_peer(monkeypatch)
  with pytest.raises(SystemExit):
    evaluation._agreed(0, choose=lambda: ("stop", None))  # pylint: disable=protected-access
  assert exits == ["0 3 OSError: disk gone"]


def test_a_checkpoint_dir_on_storage_not_shared_is_one_line_naming_it(monkeypatch, tmp_path):
  # A cluster whose checkpoint_dir is each host's local disk: mesh saves hung
  # in orbax's barrier for 5 minutes, ignoring SIGTERM.
  from jaxline_ng import platform, run_lock  # pylint: disable=import-outside-toplevel
  store = DictStore()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
  monkeypatch.setattr(agreement, "_run_index", agreement._run_index)  # pylint: disable=protected-access
  shared, local = str(tmp_path / "shared"), str(tmp_path / "local")
  with run_lock.held(shared, "train"):
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 0)
    platform._check_checkpoint_dir_is_shared(shared, "train")  # pylint: disable=protected-access
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 1)
    platform._check_checkpoint_dir_is_shared(shared, "train")  # pylint: disable=protected-access
    multihost.begin_run()  # The next run's keys.
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 0)
    platform._check_checkpoint_dir_is_shared(shared, "train")  # pylint: disable=protected-access
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 1)
    with pytest.raises(multihost.MultihostError, match=(
        r"^process 1 sees config.checkpoint_dir unlike process 0: its lock=None \(process 0: "
        r"'process \d+ on host .*\); config.checkpoint_dir='.*/local' must be one directory "
        "that every process shares$")):
      platform._check_checkpoint_dir_is_shared(local, "train")  # pylint: disable=protected-access


def test_single_process_helpers_are_identities():
  assert multihost.broadcast_from_chief({"a": 1}) == {"a": 1}
  assert multihost.all_reduce_sum({"n": 3})["n"] == 3
  multihost.barrier("noop")


def test_processes_launched_with_different_configs_stop_at_once_naming_the_key(tmp_path):
  # Each process computes its own training_steps: 50 on process 0, 60 on process 1.
  command = " ".join(toy(tmp_path, "--config.training_steps=$((50 + 10 * JAX_PROCESS_ID))"))
  result = launch(["sh", "-c", f"exec {command}"], timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 was launched unlike process 0: "
          "config.training_steps=60 (process 0: 50); every process of a run takes the same "
          "mode and config") in result.stdout, result.stdout[-4000:]
  assert not os.path.exists(tmp_path / "checkpoints" / "latest")  # Nothing trained.


def test_processes_may_reach_one_checkpoint_dir_by_different_paths_but_not_two_dirs(tmp_path):
  # Hosts mounting the shared storage at different paths were refused as
  # launched unlike each other; two directories are refused by the lock check.
  shared = tmp_path / "shared"
  shared.mkdir()
  os.symlink(shared, tmp_path / "link")
  command = " ".join(toy("$DIR", "--config.training_steps=4"))
  result = launch(["sh", "-c", f"DIR={tmp_path}/$([ $JAX_PROCESS_ID = 0 ] && echo shared || "
                               f"echo link); exec {command}"], timeout=120)
  assert result.returncode == 0, result.stdout[-4000:]
  assert os.listdir(shared / "checkpoints" / "latest") == ["4"]

  result = launch(["sh", "-c", f"DIR={tmp_path}/$([ $JAX_PROCESS_ID = 0 ] && echo shared || "
                               f"echo other); exec {command}"], timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 sees config.checkpoint_dir unlike process 0: its "
          "lock=None") in result.stdout, result.stdout[-4000:]
  assert f"config.checkpoint_dir='{tmp_path}/other' must be one directory that every process " \
      "shares" in result.stdout, result.stdout[-4000:]


def test_a_difference_from_a_chief_that_has_failed_since_exits_on_the_chiefs_failure(
    monkeypatch):
  # Process 0 published its lock, failed on the config and released the lock:
  # process 1 then saw no lock, and named that instead of the config error.
  monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
  monkeypatch.setattr(distributed, "is_chief", lambda: False)
  store = DictStore()
  monkeypatch.setattr(agreement, "_key_value_store", lambda: store)
  monkeypatch.setattr(agreement, "_ending", type(agreement._ending)())  # pylint: disable=protected-access
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 0)
  agreement.exchange("as_chief/sees_config.checkpoint_dir",
                     json.dumps({"lock": "process 7 on host h"}), read_from=())
  multihost.publish_failure("config.x=1 is wrong", 1)
  monkeypatch.setattr(agreement.jax, "process_index", lambda: 1)
  exits = record_exits_for_peer(monkeypatch)
  with pytest.raises(SystemExit):
    multihost.check_same_as_chief("sees config.checkpoint_dir", lambda: {"lock": None}, "why")
  assert exits == ["0 1 config.x=1 is wrong"]


def test_mesh_saves_timed_in_seconds_are_refused_at_once_naming_the_key(tmp_path):
  # Every process writes its shards of a mesh-mode save, so each must save the
  # same step; each one's own clock would pick another, and the collective abort.
  result = launch(toy(tmp_path, "--config.placement=mesh", "--config.mesh_shape=data:-1",
                      "--config.random_mode_train=same_host_same_device",
                      "--config.interval_type=secs"), timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  for process in (0, 1):  # Its own error, or the first one's, which it exits on.
    assert any(line.startswith(f"[p{process}]") and "config.interval_type='secs' times saves "
               "by each process's own clock" in line
               for line in result.stdout.splitlines()), result.stdout[-4000:]
  assert not os.path.exists(tmp_path / "checkpoints" / "latest")  # Nothing trained.


def test_a_process_given_another_process_count_stops_at_once_naming_the_flag(tmp_path):
  command = " ".join(toy(tmp_path, "--jaxline_num_processes=$((2 + JAX_PROCESS_ID))"))
  result = launch(["sh", "-c", f"exec {command}"], timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 was launched unlike process 0: "
          "--jaxline_num_processes=3 (process 0: 2)") in result.stdout, result.stdout[-4000:]


@pytest.mark.parametrize("args,culprit", [
    (["--jaxline_process_id=1"], "--jaxline_process_id=1 needs --jaxline_num_processes"),
    (["--jaxline_coordinator_address=localhost:1234"],
     "--jaxline_coordinator_address=localhost:1234 needs --jaxline_num_processes"),
    (["--jaxline_num_processes=-2"], "--jaxline_num_processes=-2 must be at least 1"),
    (["--jaxline_num_processes=2", "--jaxline_process_id=0",
      "--jaxline_coordinator_address=localhost"],
     "--jaxline_coordinator_address=localhost must be host:port"),
    (["--jaxline_num_processes=2", "--jaxline_process_id=0",
      "--jaxline_coordinator_address=localhost:99999"],
     "--jaxline_coordinator_address=localhost:99999 must be host:port, the port in 1..65535"),
    (["JAX_NUM_PROCESSES=abc"], "$JAX_NUM_PROCESSES='abc' is not an integer"),
    # JAX retried the name for its whole 300 s timeout, then aborted.
    (["--jaxline_num_processes=2", "--jaxline_process_id=1",
      "--jaxline_coordinator_address=nohost.invalid:24040"],
     "--jaxline_coordinator_address=nohost.invalid:24040: cannot resolve 'nohost.invalid'"),
])
def test_incomplete_multiprocess_flags_stop_naming_the_flag(args, culprit):
  """Each ran silently as a single process (or failed in JAX with a traceback)."""
  code = ("import sys\nfrom absl import flags\nfrom jaxline_ng import multihost\n"
          "from jaxline_ng.errors import OneLineError\n"
          "flags.FLAGS(sys.argv)\n"
          "try:\n  multihost.initialize_if_requested()\n"
          "except multihost.MultihostError as e:\n"
          "  print('error:', e, isinstance(e, OneLineError))\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
  env.update(arg.split("=", 1) for arg in args if not arg.startswith("--"))  # Variables.
  flags = [arg for arg in args if arg.startswith("--")]
  result = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True,
                          timeout=60, env=env)
  assert result.stdout.startswith(f"error: {culprit}"), result.stderr[-2000:]
  assert result.stdout.strip().endswith("True")


def test_a_program_that_used_jax_before_platform_main_is_told_what_to_do():
  # jaxline never started JAX's distributed runtime; jax_privacy builds its
  # experiment, with JAX, before calling platform.main.
  code = ("import sys\nimport jax\nfrom absl import flags\nfrom jaxline_ng import multihost\n"
          "from jaxline_ng.errors import OneLineError\n"
          "flags.FLAGS(sys.argv)\njax.local_device_count()\n"
          "try:\n  multihost.initialize_if_requested()\n"
          "except multihost.MultihostError as e:\n"
          "  print('error:', e, isinstance(e, OneLineError))\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
  result = subprocess.run(
      [sys.executable, "-c", code, "--jaxline_num_processes=2", "--jaxline_process_id=1",
       "--jaxline_coordinator_address=127.0.0.1:1"], capture_output=True, text=True, timeout=60,
      env=env)
  assert result.stdout.startswith("error: this program used JAX before platform.main"), (
      result.stdout + result.stderr[-2000:])
  assert "jax.distributed.initialize()" in result.stdout


def test_process_0_on_a_port_another_coordinator_holds_stops_naming_the_address():
  """JAX's coordination service listens with SO_REUSEPORT: a second one on a taken port
  (a stale process 0, two processes given id 0) starts silently and the run hangs."""
  with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as stale:
    stale.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    stale.bind(("::", 0))
    stale.listen()
    port = stale.getsockname()[1]
    code = ("import sys\nfrom absl import flags\nfrom jaxline_ng import multihost\n"
            "from jaxline_ng.errors import OneLineError\n"
            "flags.FLAGS(sys.argv)\n"
            "try:\n  multihost.initialize_if_requested()\n"
            "except multihost.MultihostError as e:\n"
          "  print('error:', e, isinstance(e, OneLineError))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    try:
      result = subprocess.run(
          [sys.executable, "-c", code, "--jaxline_num_processes=2", "--jaxline_process_id=0",
           f"--jaxline_coordinator_address=127.0.0.1:{port}"],
          capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process 0 started a second coordination service on port {port}")
  assert result.stdout.startswith(
      f"error: --jaxline_coordinator_address=127.0.0.1:{port}: port {port} is in use"), (
          result.stdout + result.stderr[-2000:])


TWICE = """
import functools, os, sys
from absl import app, flags
sys.path.insert(0, {experiments!r})
import toy
from jaxline_ng import platform

def main(argv):
  # emergent_in_context_learning's main: platform.main, then platform.main again.
  platform.main(toy.Experiment, argv)
  platform.main(toy.Experiment, argv)

if __name__ == "__main__":
  app.run(main)
"""


def test_platform_main_twice_in_one_program_and_a_rerun_of_a_finished_run(tmp_path):
  script = tmp_path / "twice.py"
  script.write_text(TWICE.format(experiments=EXPERIMENTS))
  # The second call finds the run finished: it restores the last step, runs
  # none, and saves it again, which waits for process 1's verdict on it.
  result = launch([sys.executable, str(script), *toy(tmp_path / "run")[2:],
                   "--config.training_steps=6"], timeout=120)
  assert result.returncode == 0, result.stdout[-4000:]
  restored = [line for line in result.stdout.splitlines() if "Restored checkpoint" in line]
  assert sorted(line.split()[0] for line in restored) == ["[p0]", "[p1]"]
  assert final_params(tmp_path / "run")[0] == 6


def test_processes_that_see_different_checkpoints_stop_at_once_naming_the_dir(tmp_path):
  # A checkpoint_dir on a disk each host has its own of: process 1 sees no checkpoint.
  single_process(toy(tmp_path, "--config.training_steps=20"))
  script = tmp_path / "own_disk.py"
  script.write_text(
      "import os, runpy, sys\n"
      "from jaxline_ng import disk_checkpointing\n"
      "if os.environ['JAX_PROCESS_ID'] == '1':\n"
      "  disk_checkpointing.DiskCheckpointer.can_be_restored = lambda self, series: False\n"
      f"sys.argv = [{TOY!r}] + sys.argv[1:]\n"
      f"runpy.run_path({TOY!r}, run_name='__main__')\n")
  result = launch([sys.executable, str(script), *toy(tmp_path, "--config.training_steps=40")[2:]],
                  timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 resumed unlike process 0: from step=0 (process 0: "
          "20); every process must see the same checkpoints: give them one shared "
          "checkpoint_dir") in result.stdout, result.stdout[-4000:]
  assert disk_checkpointing.read(str(tmp_path))[0] == 20  # Nothing trained on.


def test_processes_with_different_device_counts_stop_at_once_naming_them(tmp_path):
  command = " ".join(toy(tmp_path))
  result = launch(["sh", "-c", "XLA_FLAGS=\"$XLA_FLAGS --xla_force_host_platform_device_count="
                   f"$((2 + 2 * JAX_PROCESS_ID))\" exec {command}"], timeout=120)
  assert result.returncode == 1, result.stdout[-4000:]
  assert ("[p1] jaxline_ng: error: process 1 was launched unlike process 0: local devices=4 "
          "(process 0: 2)") in result.stdout, result.stdout[-4000:]


def test_char_lm_in_mesh_mode_over_two_processes_saves_and_resumes(tmp_path):
  # Its batches were gathered across processes on the prefetch thread while
  # the training thread saved: the collectives met in another order in each
  # process, and the run hung at its first save, every time.
  command = [sys.executable, "examples/char_lm/experiment.py",
             "--config=examples/char_lm/experiment.py:smoke", "--config.placement=mesh",
             "--config.mesh_shape=data:-1,model:4",
             "--config.random_mode_train=same_host_same_device", "--config.checkpointer=disk",
             f"--config.checkpoint_dir={tmp_path}", "--config.tensorboard=False"]
  first = launch([*command, "--config.training_steps=10"], timeout=150)
  assert first.returncode == 0, first.stdout[-4000:]
  assert disk_checkpointing.read(str(tmp_path))[0] == 10
  resumed = launch([*command, "--config.training_steps=15"], timeout=150)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  assert resumed.stdout.count(os.path.join("latest", "10") + ".") == 2  # Both restored step 10.
  assert disk_checkpointing.read(str(tmp_path))[0] == 15


COLLECTIVE_OFF_THREAD = """
import sys, threading
import numpy as np
from absl import flags
from jaxline_ng import multihost
flags.FLAGS(sys.argv)
multihost.initialize_if_requested()
multihost.own_collectives()
print("sum on the training thread:", multihost.all_reduce_sum(np.ones(2)).tolist(), flush=True)
def off_thread():
  try:
    multihost.all_reduce_sum(np.ones(2))
  except multihost.CollectiveThreadError as e:
    print("refused:", e, flush=True)
  multihost.rendezvous("twice")  # A barrier through the store: any thread, any number of times.
  multihost.rendezvous("twice")
  print("passed the barrier twice", flush=True)
thread = threading.Thread(target=off_thread, name="py_prefetch")
thread.start()
thread.join()
"""


def test_a_collective_off_the_training_thread_is_refused_and_barriers_take_any_thread(tmp_path):
  script = tmp_path / "collective_off_thread.py"
  script.write_text(COLLECTIVE_OFF_THREAD)
  result = launch([sys.executable, str(script)], timeout=120)
  assert result.returncode == 0, result.stdout[-4000:]
  for process in range(2):
    assert f"[p{process}] sum on the training thread: [2.0, 2.0]" in result.stdout
    assert (f"[p{process}] refused: all_reduce_sum is a collective across processes, called on "
            "thread 'py_prefetch'") in result.stdout, result.stdout[-4000:]
    assert f"[p{process}] passed the barrier twice" in result.stdout
