"""Runs that stop making progress end, saying where, and leave no process behind.

Real processes: the toy experiment with a step that never returns
(`hang_at_step`), alone and under `jaxline_ng.launch`.
"""

import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
from helpers import ENV, ROOT, TOY, launch_command, run, running
from helpers import toy_command as toy


class Launch:
  """A launcher run in the background; its output lines collected as they come."""

  def __init__(self, command, *launcher_flags):
    self.process = subprocess.Popen(launch_command(command, *launcher_flags), cwd=ROOT, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line)

  def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sum(text in line for line in self.lines) < count:
      assert time.monotonic() < deadline, "".join(self.lines)[-4000:]
      time.sleep(0.1)

  def pids(self) -> list[int]:
    return [int(line.split()[-1]) for line in self.lines if line.startswith("[launch] process")
            and ": pid " in line]

  def output(self) -> str:
    self._reader.join(timeout=10)
    return "".join(self.lines)


def test_a_step_that_never_returns_ends_the_run_with_every_threads_stack(tmp_path):
  started = time.monotonic()
  result = run(toy(tmp_path, "--config.experiment_kwargs.config.hang_at_step=3",
                   "--config.step_timeout_secs=2"))
  assert result.returncode == 1, result.stderr[-4000:]
  assert time.monotonic() - started < 60
  assert result.stderr.rstrip().endswith(
      "jaxline_ng: error: no training step has finished for 2 s (config.step_timeout_secs: "
      "2 s); the run is stuck after step 3"), result.stderr[-4000:]
  # Where it is stuck: the training thread's stack, in the experiment's step.
  assert f'File "{os.path.join(ROOT, TOY)}", line' in result.stderr
  assert "in step" in result.stderr and "in train_loop" in result.stderr


@pytest.mark.parametrize("stuck_process", [0, 1])
def test_a_process_stuck_in_its_step_ends_the_run_of_two(tmp_path, stuck_process):
  # Process 0 hosts JAX's coordination service: stuck first, it must not take
  # the other down with it (SIGABRT) before that one hears of the failure.
  launch = Launch(toy(tmp_path, "--config.experiment_kwargs.config.hang_at_step=3",
                      f"--config.experiment_kwargs.config.fail_on_process={stuck_process}",
                      "--config.step_timeout_secs=3"))
  assert launch.process.wait(timeout=120) == 1, launch.output()[-4000:]
  output = launch.output()
  # Process 0 waits in the step's collective for process 1: both are stuck,
  # and whichever watchdog fires first ends the run. Process 0's host loop may
  # have dispatched a few steps past 3 before its device waits.
  stuck_after = re.search(r"jaxline_ng: error: no training step has finished for 3 s "
                          r"\(config.step_timeout_secs: 3 s\); the run is stuck after step "
                          r"(\d+)\n", output)
  assert stuck_after and int(stuck_after.group(1)) >= 3, output
  assert "[launch] exit codes: process 0: 1, process 1: 1" in output, output
  pids = launch.pids()
  assert len(pids) == 2 and not any(running(pid) for pid in pids), output[-4000:]


def launch_stuck(tmp_path, stop_grace_secs: int) -> Launch:
  """Two processes in a step that never returns, their watchdogs off."""
  launch = Launch(toy(tmp_path, "--config.experiment_kwargs.config.hang_at_step=2",
                      "--config.step_timeout_secs=0"), f"--stop_grace_secs={stop_grace_secs}")
  launch.wait_for("training loop starting", count=2)
  time.sleep(2)  # Into the step that never returns.
  return launch


def test_the_launcher_kills_processes_that_do_not_stop_within_its_grace(tmp_path):
  # It passed SIGTERM on once and waited forever for processes stuck in a step.
  launch = launch_stuck(tmp_path, stop_grace_secs=3)
  launch.process.send_signal(signal.SIGTERM)
  assert launch.process.wait(timeout=60) != 0
  output = launch.output()
  assert ("[launch] processes 0, 1 did not stop within 3s (--stop_grace_secs) of the SIGTERM "
          "passed on: killing them") in output, output[-4000:]
  pids = launch.pids()
  assert len(pids) == 2 and not any(running(pid) for pid in pids), output[-4000:]


def test_processes_of_a_killed_launcher_end_within_its_grace(tmp_path):
  # Killed outright, the launcher left both processes of a stuck run running
  # for good, holding their devices and the run's lock.
  launch = launch_stuck(tmp_path, stop_grace_secs=2)
  pids = launch.pids()
  assert len(pids) == 2
  launch.process.kill()
  launch.process.wait()
  deadline = time.monotonic() + 15
  while any(running(pid) for pid in pids):
    assert time.monotonic() < deadline, f"still running: {[p for p in pids if running(p)]}"
    time.sleep(0.2)


def test_a_process_given_another_coordinator_address_ends_the_run_naming_the_addresses(tmp_path):
  # Process 1 told another port: both waited 5 minutes in JAX's join, then
  # JAX aborted them naming nothing.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    wrong = f"127.0.0.1:{s.getsockname()[1]}"
  command = " ".join(toy(tmp_path, "--jaxline_distributed_timeout=4"))
  started = time.monotonic()
  launch = Launch(["sh", "-c", f'[ "$JAX_PROCESS_ID" = 1 ] && '
                   f'export JAX_COORDINATOR_ADDRESS={wrong}; exec {command}'])
  assert launch.process.wait(timeout=120) == 1, launch.output()[-4000:]
  assert time.monotonic() - started < 60
  output = launch.output()
  assert (f"[p1] jaxline_ng: error: process 1 of 2: the run's processes did not all join at "
          f"{wrong} within 4 s (--jaxline_distributed_timeout)") in output, output[-4000:]
  assert "[p0] jaxline_ng: error: process 0 of 2: the run's processes did not all join at " \
      "127.0.0.1:" in output, output[-4000:]
