"""Multi-process runs stop together: real 2-process runs over loopback via jaxline_ng.launch.

Every reason to stop is agreed across the processes: a SIGTERM reaching one
of them or both at different moments, the wall-clock budget (requested
stops: every process stops after the same step, the chief saves it, all exit
75 and the rerun continues exactly), a NaN only one process sees and an
exception in one process (failures: every process exits 1 at once, nothing
after the failure is saved). A signal to the launcher reaches every
process. The processes of an eval job beside training take the same disk
checkpoints, and stop together at once when one is signalled, in both
placements. Each run has a timeout.
"""

import fcntl
import os
import pathlib
import re
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from helpers import ENV, ROOT, TOY, launch_command, running, toy_command

from jaxline_ng import disk_checkpointing, run_lock

STEPS = 100
# Paces the interrupted runs: 100 steps take 3 s or more, so a signal sent
# after step 30 (or a second one 0.5 s later) lands mid-run.
PACED = "--config.experiment_kwargs.config.step_sleep_secs=0.03"
TIMEOUT_SECS = 150


def toy(checkpoint_dir, *extra, script=TOY):
  return toy_command(checkpoint_dir, f"--config.training_steps={STEPS}", *extra, script=script)


class Launch:
  """A `jaxline_ng.launch` run of 2 processes x 2 devices, its output collected as it comes."""

  def __init__(self, command):
    self.process = subprocess.Popen(launch_command(command), cwd=ROOT, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self._deadline = time.monotonic() + TIMEOUT_SECS

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line.rstrip("\n"))

  @property
  def output(self) -> str:
    return "\n".join(self.lines[-150:])

  def wait_for(self, pattern: str) -> re.Match:
    while time.monotonic() < self._deadline:
      for line in list(self.lines):
        match = re.search(pattern, line)
        if match:
          return match
      if self.process.poll() is not None and not self._reader.is_alive():
        break
      time.sleep(0.05)
    self.kill()
    pytest.fail(f"no line matched {pattern!r}:\n{self.output}")

  def pid(self, index: int) -> int:
    return int(self.wait_for(rf"^\[launch\] process {index}: pid (\d+)").group(1))

  def finish(self) -> int:
    try:
      self.process.wait(timeout=max(1.0, self._deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.kill()
      pytest.fail(f"the run did not end within {TIMEOUT_SECS}s:\n{self.output}")
    self._reader.join(timeout=10)
    return self.process.returncode

  def kill(self):
    for index in range(2):
      for line in self.lines:
        match = re.search(rf"^\[launch\] process {index}: pid (\d+)", line)
        if match:
          try:
            os.kill(int(match.group(1)), signal.SIGKILL)
          except ProcessLookupError:
            pass
    self.process.kill()

  def exit_codes(self) -> list[int]:
    match = self.wait_for(r"^\[launch\] exit codes: process 0: (-?\d+), process 1: (-?\d+)")
    return [int(match.group(1)), int(match.group(2))]

  def agreed_steps(self) -> list[int]:
    """The step each process says it stopped after, by process."""
    return [int(self.wait_for(rf"^\[p{index}\] .*stopped after step (\d+), the step every "
                              "process agreed on").group(1)) for index in range(2)]


def run(command) -> Launch:
  launch = Launch(command)
  launch.finish()
  return launch


def latest(checkpoint_dir) -> tuple[int, np.ndarray]:
  step, nest = disk_checkpointing.read(str(checkpoint_dir))
  return step, np.asarray(nest["experiment_module"]["params"])


def shared_run(tmp_path_factory, worker_id, name: str, *extra) -> pathlib.Path:
  """The directory of a 2-process toy run that several tests read, made once.

  Under pytest-xdist the workers share it (in the session's directory, which
  they have in common) instead of each making its own: each such run costs
  seconds of the suite's 5 minutes.
  """
  shared = worker_id != "master"
  root = tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.getbasetemp()
  run_dir = root / name
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if not (root / f"{name}.done").exists():
      launch = run(toy(run_dir, *extra))
      assert launch.process.returncode == 0, launch.output
      (root / f"{name}.done").touch()
  return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, worker_id):
  """The final parameters of a 2-process run of all the steps, never stopped."""
  # Saves only at the end: the parameters do not depend on when it saves.
  run_dir = shared_run(tmp_path_factory, worker_id, "uninterrupted",
                       "--config.save_checkpoint_interval=1000")
  step, params = latest(run_dir)
  assert step == STEPS
  return params


def _stop_then_resume_exactly(run_dir, uninterrupted, launch: Launch, resume=True) -> int:
  """Checks a requested stop ended together and saved the agreed step; resumes
  (unless not `resume`: the save and resume paths are the same whoever was
  signalled, and each launch costs seconds of the suite's 5 minutes); that step."""
  code = launch.finish()
  assert code == 75, launch.output
  assert launch.exit_codes() == [75, 75], launch.output
  agreed = launch.agreed_steps()
  assert agreed[0] == agreed[1] < STEPS, launch.output
  step, _ = latest(run_dir)
  assert step == agreed[0], launch.output
  if not resume:
    return agreed[0]

  resumed = run(toy(run_dir))  # Unpaced: nothing interrupts it.
  assert resumed.process.returncode == 0, resumed.output
  assert resumed.exit_codes() == [0, 0]
  for index in range(2):
    resumed.wait_for(rf"^\[p{index}\] .*Restored checkpoint .*latest{os.sep}{agreed[0]}\b")
  step, params = latest(run_dir)
  assert step == STEPS
  np.testing.assert_array_equal(params, uninterrupted)
  return agreed[0]


@pytest.mark.parametrize("signalled, signum", [
    ([1], signal.SIGTERM), ([0], signal.SIGTERM), ([0, 1], signal.SIGTERM),
    ([1], signal.SIGINT), (["launcher"], signal.SIGTERM)],
    ids=["process_1_only", "process_0_only", "both_half_a_second_apart", "ctrl_c_to_process_1",
         "to_the_launcher"])
def test_a_signal_to_some_processes_stops_all_after_one_agreed_step(
    tmp_path, uninterrupted, signalled, signum):
  launch = Launch(toy(tmp_path, PACED))
  pids = {0: launch.pid(0), 1: launch.pid(1), "launcher": launch.process.pid}
  launch.wait_for(r"^\[p0\] .*step (3\d|[4-9]\d|\d\d\d)/")
  for i, index in enumerate(signalled):
    if i:
      time.sleep(0.5)
    os.kill(pids[index], signum)
  # Resumed once, after the stop of a process other than the chief, which saves.
  _stop_then_resume_exactly(tmp_path, uninterrupted, launch,
                            resume=signalled == [1] and signum == signal.SIGTERM)


@pytest.mark.parametrize("index", [0, 1])
def test_a_second_ctrl_c_to_one_process_ends_every_process_at_once_with_75(tmp_path, index):
  # Its peers would otherwise wait for it in a collective until JAX's heartbeat aborts them.
  launch = Launch(toy(tmp_path, "--config.experiment_kwargs.config.step_sleep_secs=0.05",
                      "--config.training_steps=3000"))
  pid = launch.pid(index)
  launch.wait_for(r"^\[p0\] .*step (3\d|[4-9]\d|\d\d\d)/")
  os.kill(pid, signal.SIGINT)
  time.sleep(0.1)
  os.kill(pid, signal.SIGINT)
  signalled = time.monotonic()
  assert launch.finish() == 75, launch.output
  assert launch.exit_codes() == [75, 75], launch.output
  assert time.monotonic() - signalled < 30, launch.output


def test_the_wall_clock_budget_stops_every_process_after_one_agreed_step(tmp_path):
  launch = Launch(toy(tmp_path, PACED, "--config.wall_clock_budget_secs=2"))
  launch.wait_for(r"^\[p0\] .*wall-clock budget of 2s is spent")
  _stop_then_resume_exactly(tmp_path, None, launch, resume=False)


def saved_steps(checkpoint_dir) -> list[int]:
  series = os.path.join(str(checkpoint_dir), "checkpoints", "latest")
  return sorted(int(name) for name in os.listdir(series) if name.isdigit())


def test_an_exception_in_process_1_ends_every_process_with_its_code(tmp_path):
  launch = run(toy(tmp_path, PACED, "--config.experiment_kwargs.config.fail_at_step=33",
                   "--config.experiment_kwargs.config.fail_on_process=1"))
  assert launch.process.returncode == 1, launch.output
  assert launch.exit_codes() == [1, 1], launch.output
  launch.wait_for(r"^\[p1\] .*RuntimeError: toy experiment fails at step 33")
  launch.wait_for(r"^\[p0\] .*Process 1 failed \(RuntimeError: toy experiment fails at step 33\); "
                  "process 0 exits with code 1 too")
  launch.wait_for(r"^\[launch\] process 1 failed with exit code 1")
  # Step 33 never completed, so no later step was saved.
  assert saved_steps(tmp_path) and max(saved_steps(tmp_path)) <= 30, saved_steps(tmp_path)
  assert "stopping them" not in launch.output  # Process 0 ended on its own.


def test_a_nan_only_process_1_sees_ends_every_process_without_saving_after_it(tmp_path):
  launch = run(toy(tmp_path, PACED, "--config.log_tensors_interval=1",
                   "--config.experiment_kwargs.config.nan_from_step=25",
                   "--config.experiment_kwargs.config.nan_on_process=1"))
  assert launch.process.returncode == 1, launch.output
  assert launch.exit_codes() == [1, 1], launch.output
  launch.wait_for(r"^\[p1\] jaxline_ng: error: non-finite training scalars loss at step 26 ")
  launch.wait_for(r"^\[p0\] .*Process 1 failed \(NonFiniteError: non-finite training scalars")
  # Process 1 stops after step 26, so no step after the NaN completes or is saved.
  assert saved_steps(tmp_path) and max(saved_steps(tmp_path)) <= 20, saved_steps(tmp_path)


def test_an_eval_job_beside_training_evaluates_the_same_steps_in_every_process(tmp_path):
  training = Launch(toy(tmp_path, PACED))
  # It expects more steps than training makes: it ends with the run's last
  # checkpoint once the run has let go of the directory, in every process.
  evaluation = Launch(toy(tmp_path, "--jaxline_mode=eval", "--config.training_steps=1000",
                          "--config.eval_poll_interval_secs=0.2"))
  assert training.finish() == 0, training.output
  assert evaluation.finish() == 0, evaluation.output
  assert evaluation.exit_codes() == [0, 0], evaluation.output
  evaluation.wait_for(rf"^\[p0\] .*Step {STEPS} ended the training run that saved it")
  # The processes restore the disk checkpoints together, so they take the
  # same ones (the chief's choice) even as training saves new ones.
  evaluated = [[int(match.group(1)) for line in evaluation.lines
                if (match := re.search(rf"^\[p{index}\] .*eval step (\d+):", line))]
               for index in range(2)]
  assert evaluated[0] == evaluated[1] and len(evaluated[0]) > 1, evaluation.output


def test_a_stop_asked_of_another_process_ends_a_waiting_eval_job_at_once(tmp_path):
  # The chief looks for a checkpoint every eval_poll_interval_secs (10 s by
  # default); it must not sleep through a stop asked of another process.
  launch = Launch(toy(tmp_path, "--jaxline_mode=eval"))
  pid = launch.pid(1)
  launch.wait_for(r"^\[p0\] .*Waiting for a new checkpoint")
  launch.wait_for(r"^\[p1\] .*mode=eval checkpoint_dir")
  signalled = time.monotonic()
  os.kill(pid, signal.SIGTERM)
  assert launch.finish() == 75, launch.output
  assert launch.exit_codes() == [75, 75], launch.output
  assert time.monotonic() - signalled < 5, launch.output


def test_a_sigterm_while_an_eval_job_sets_up_stops_it(tmp_path):
  # Once JAX's runtime had started it took SIGTERM for its preemption
  # service, which an eval job never consults, until jaxline_ng's own
  # handling began: a signal in between (the config and launch checks) was
  # swallowed and the job waited forever.
  launch = Launch(toy(tmp_path, "--jaxline_mode=eval"))
  pid = launch.pid(1)
  launch.wait_for(r"^\[p1\] .*Process 1 of 2; 2 local devices")
  os.kill(pid, signal.SIGTERM)
  assert launch.finish() == 75, launch.output
  assert launch.exit_codes() == [75, 75], launch.output


MESH = ("--config.placement=mesh", "--config.mesh_shape=data:-1,model:4",
        "--config.experiment_kwargs.config.dim=4",
        "--config.random_mode_train=same_host_same_device")


@pytest.fixture
def mesh_trained(tmp_path, tmp_path_factory, worker_id):
  """`tmp_path` holding a copy of a 20-step mesh run, parameters sharded over both processes."""
  trained = shared_run(tmp_path_factory, worker_id, "mesh_trained",
                       "--config.training_steps=20", *MESH)
  shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
  return tmp_path


def test_sigterm_to_one_process_of_a_mesh_eval_job_stops_every_process(mesh_trained):
  # Each process restores its shards of the checkpoint the chief chose, together.
  # The eval job waits for step 1000's checkpoint while a training run holds
  # the directory (as one extending the run would).
  with run_lock.held(str(mesh_trained), "train"):
    launch = Launch(toy(mesh_trained, "--jaxline_mode=eval", "--config.training_steps=1000",
                        "--config.eval_poll_interval_secs=0.2", *MESH))
    pids = [launch.pid(0), launch.pid(1)]
    for index in range(2):
      launch.wait_for(rf"^\[p{index}\] .*eval step 20:")
    os.kill(pids[1], signal.SIGTERM)
    # Stopped on request: 75 in every mode and every process.
    assert launch.finish() == 75, launch.output
  assert launch.exit_codes() == [75, 75], launch.output


def test_a_mesh_eval_job_goes_on_together_when_a_process_loses_a_race_with_rotation(
    mesh_trained):
  # Process 1 finds the chief's choice rotated out just before reading it;
  # process 0 reads its shards or not. Both go on to the newer checkpoint
  # instead of one waiting for the other in a barrier or collective.
  # Step 20 is saved "later", while process 1 loses the race for step 10.
  os.makedirs(mesh_trained / "saved_later")
  os.rename(mesh_trained / "checkpoints" / "latest" / "20", mesh_trained / "saved_later" / "20")
  launch = run(toy(mesh_trained, "--jaxline_mode=eval", "--config.training_steps=20", *MESH,
                   script=os.path.join("tests", "experiments", "toy_loses_a_race.py")))
  assert launch.exit_codes() == [0, 0], launch.output
  launch.wait_for(r"^\[p1\] .*Not evaluated: .*going on")
  for index in range(2):
    evaluated = [line for line in launch.lines
                 if re.search(rf"^\[p{index}\] .*eval step 20:", line)]
    assert len(evaluated) == 1, launch.output


def test_train_eval_multithreaded_over_processes_is_refused_naming_the_eval_job(tmp_path):
  launch = run(toy(tmp_path, "--jaxline_mode=train_eval_multithreaded"))
  assert launch.exit_codes() == [1, 1], launch.output
  launch.wait_for(r"^\[p\d\] jaxline_ng: error: --jaxline_mode=train_eval_multithreaded over 2 "
                  r"processes: .* run --jaxline_mode=eval")


class _Ended:
  def __init__(self, returncode):
    self.returncode = returncode


@pytest.mark.parametrize("codes, ended_at, named, signalled, expected", [
    # Killed from outside first (OOM); its peer then logged its own failure.
    ([1, -9], [15, 0], (0,), set(), (-9, 1)),
    # The same kill, sent by the launcher to stop a process: the named failure is the cause.
    ([1, -9], [15, 0], (0,), {1}, (1, 0)),
    # JAX aborts a process whose peer is gone: a consequence, not the cause.
    ([1, -6], [1, 0], (0,), set(), (1, 0)),
    # A crash after the named failure was its consequence.
    ([1, -11], [0, 2], (0,), set(), (1, 0)),
])
def test_the_launcher_blames_a_process_killed_from_outside(codes, ended_at, named, signalled,
                                                           expected):
  from jaxline_ng import launch as launch_lib  # pylint: disable=import-outside-toplevel
  processes = [_Ended(code) for code in codes]
  assert launch_lib._run_exit_code(  # pylint: disable=protected-access
      processes, dict(enumerate(ended_at)), named, signalled) == expected


@pytest.mark.parametrize("codes, ended_at, named, expected", [
    ([75, 75], [0, 1], (), (75, None)),  # Stopped on request.
    ([0, 0], [0, 1], (), (0, None)),
    ([75, 1], [0, 1], (), (1, 1)),  # A failure outranks a requested stop.
    ([1, 1], [5, 2], (), (1, 1)),  # The first process to fail is the cause.
    ([-9, 2], [0, 1], (), (2, 1)),  # An error exit before a death by signal.
    # Ended in the same poll: the process the logs first name as failed is the cause.
    ([1, 1], [3, 3], (1, 1), (1, 1)),
])
def test_the_launcher_exits_75_only_when_every_process_stopped_on_request(codes, ended_at, named,
                                                                            expected):
  from jaxline_ng import launch as launch_lib  # pylint: disable=import-outside-toplevel
  processes = [_Ended(code) for code in codes]
  assert launch_lib._run_exit_code(  # pylint: disable=protected-access
      processes, dict(enumerate(ended_at)), named) == expected


def test_processes_of_a_launcher_killed_outright_stop_saved(tmp_path):
  # A scheduler's kill -9 of the launcher: processes left running held the
  # run's lock against the rerun.
  launch = Launch(toy(tmp_path, PACED, "--config.training_steps=100000"))
  pids = [launch.pid(0), launch.pid(1)]
  launch.wait_for(r"^\[p0\] .*step (3\d|[4-9]\d|\d\d\d)/")
  launch.process.kill()
  deadline = time.monotonic() + 60
  while any(map(running, pids)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(map(running, pids))
  step, _ = latest(tmp_path)
  rows = (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
  assert 30 <= step == int(re.search(r'"step": (\d+)', rows[-1]).group(1))
