"""Starts a multi-process run on this machine, over loopback.

    python -m jaxline_ng.launch --num_processes=2 --devices_per_process=2 -- \
        python examples/digits/experiment.py --config=examples/digits/experiment.py

Each process gets JAX's coordinator environment and `devices_per_process`
fake CPU devices; output lines are prefixed `[p<i>]`. A SIGTERM or Ctrl-C is
passed on to every process, which are killed `--stop_grace_secs` later if still
running. Exits 75 when every process did (stopped on request), else with the
code of the process that failed first (128 + N for signal N), 0 on success.
On Linux a launcher killed outright leaves no process running (`watch_the_launcher`).
"""

import argparse
import contextlib
import ctypes
import errno
import faulthandler
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

# Loaded here, not in the forked child, which may only make the call itself.
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _stop_with_the_launcher() -> None:
  """In each child, before it runs: SIGTERM when the launcher dies (else it holds
  the run's lock against the rerun)."""
  _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# How long stopped processes get to exit on SIGTERM before SIGKILL. Short: a
# process whose peer died may wait on a collective that will never complete.
_STOP_GRACE_SECS = 5.0
# After a SIGTERM or Ctrl-C passed on: long enough for a normal run's final save.
DEFAULT_STOP_GRACE_SECS = 60.0
# Set in each process's environment: the launcher's pid and its grace.
_LAUNCHER_PID_ENV = "JAXLINE_NG_LAUNCHER_PID"
_GRACE_ENV = "JAXLINE_NG_STOP_GRACE_SECS"
# jaxline_ng.preemption.EXIT_PREEMPTED (not imported: that would import JAX here).
_EXIT_PREEMPTED = 75
# How long the others get to end on their own once a process ended (the chief's
# final save may take a while), and after a failure (they learn of it at once).
_PEERS_END_SECS = 30.0
_PEERS_FAIL_SECS = 15.0


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# What a failing process, and each peer that learns of it, logs first.
_FAILURE_LINE = re.compile(r"\[jaxline_ng\] Process (\d+) failed")


def _relay(stream, prefix: str, out, lock: threading.Lock, named_failures: list[int]) -> None:
  for line in stream:
    with lock:
      out.write(f"{prefix} {line}")
      out.flush()
      match = _FAILURE_LINE.search(line)
      if match:
        named_failures.append(int(match.group(1)))


def _stop(processes, signalled: set[int]) -> None:
  for index, process in enumerate(processes):
    if process.poll() is None:
      signalled.add(index)
      process.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + _STOP_GRACE_SECS
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


def _failed(code: int | None) -> bool:
  return code not in (None, 0, _EXIT_PREEMPTED)


def _run_exit_code(processes, ended_at: dict[int, float], named_failures: tuple[int, ...] = (),
                   signalled: set[int] | None = None) -> tuple[int, int | None]:
  """The run's exit code, and the index of the process it blames (None if no failure).

  The cause is, in order: a process killed by a signal nobody in the run sent
  (an OOM kill; not the launcher's, in `signalled`, nor JAX's SIGABRT when a
  peer is gone) ending no later than any process the logs name; the first
  process the logs name as failed (peers fail within milliseconds of it); the
  first to end, an error exit before a death by signal.
  """
  failed = [i for i, p in enumerate(processes) if _failed(p.returncode)]
  named = [i for i in named_failures if i in failed]
  if signalled is not None:
    killed = [i for i in failed if processes[i].returncode < 0 and i not in signalled
              and processes[i].returncode != -signal.SIGABRT]
    if killed:
      first = min(killed, key=lambda i: (ended_at[i], i))
      if all(ended_at[first] <= ended_at[i] for i in named):
        return processes[first].returncode, first
  if named:
    return processes[named[0]].returncode, named[0]
  if failed:
    index = min(failed, key=lambda i: (processes[i].returncode < 0, ended_at[i], i))
    return processes[index].returncode, index
  if any(p.returncode == _EXIT_PREEMPTED for p in processes):
    return _EXIT_PREEMPTED, None
  return 0, None


def watch_the_launcher() -> None:
  """In a process the launcher started: once the launcher dies, ends this process
  after the launcher's grace (a stuck one would hold the run's lock against the rerun)."""
  launcher = os.environ.get(_LAUNCHER_PID_ENV)
  if not launcher or not launcher.isdigit():
    return
  grace = float(os.environ.get(_GRACE_ENV, DEFAULT_STOP_GRACE_SECS))
  parent = os.getppid()  # The launcher, or a shell it started this command under.

  def launcher_alive():
    try:
      os.kill(int(launcher), 0)
    except ProcessLookupError:
      return False
    except PermissionError:  # Its pid was taken by another user's process: it is gone.
      return False
    return os.getppid() == parent

  def watch():
    while launcher_alive():
      time.sleep(0.5)
    time.sleep(grace)
    try:  # The launcher read this process's output: there may be no one to write to.
      print(f"jaxline_ng: error: the launcher (pid {launcher}) died and this process did not "
            f"stop within {grace:g} s (--stop_grace_secs): exiting", file=sys.stderr, flush=True)
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    finally:
      os._exit(1)  # pylint: disable=protected-access  (its stuck threads never return)

  threading.Thread(target=watch, name="jaxline_ng_launcher_watch", daemon=True).start()


def port_in_use(port: int) -> bool:
  """Whether TCP `port` is in use on this host: JAX's coordinator binds with
  SO_REUSEPORT, so a second one on a taken port starts and the run hangs."""
  # "::" also covers IPv4 on a dual-stack host; without IPv6, 0.0.0.0 decides.
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict.
      try:
        probe.bind((host, port))
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          return True
        continue
      return False
  return False


def launch(command: list[str], num_processes: int, devices_per_process: int,
           port: int = 0, stop_grace_secs: float = DEFAULT_STOP_GRACE_SECS) -> int:
  """Runs `command` as `num_processes` processes; returns the run's exit code."""
  address = f"127.0.0.1:{port or _free_port()}"
  lock = threading.Lock()
  processes, relays = [], []
  named_failures: list[int] = []  # Process indices, in the order the logs name them failed.
  signalled: set[int] = set()  # Processes the launcher sent a signal.
  for index in range(num_processes):
    env = dict(os.environ,
               JAX_COORDINATOR_ADDRESS=address,
               JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(index),
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               # Processes started together join within seconds: a wrong address fails fast.
               JAXLINE_DISTRIBUTED_TIMEOUT=os.environ.get("JAXLINE_DISTRIBUTED_TIMEOUT", "30"),
               **{_LAUNCHER_PID_ENV: str(os.getpid()), _GRACE_ENV: str(stop_grace_secs)},
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={devices_per_process}"))
    # Its own process group: a terminal's Ctrl-C reaches the launcher alone,
    # which passes it on once (a second signal would mean "exit unsaved").
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1, process_group=0, preexec_fn=_stop_with_the_launcher if _LIBC else None)
    processes.append(process)
    relay = threading.Thread(
        target=_relay, args=(process.stdout, f"[p{index}]", sys.stdout, lock, named_failures),
        daemon=True)
    relay.start()
    relays.append(relay)

  for index, process in enumerate(processes):
    with lock:
      print(f"[launch] process {index}: pid {process.pid}", flush=True)

  passed_on_at: list[float] = []

  def pass_on(signum, frame):
    del frame
    passed_on_at.append(time.monotonic())
    with lock:
      print(f"[launch] {signal.Signals(signum).name}: passing it on to every process as SIGTERM",
            flush=True)
    for index, process in enumerate(processes):
      if process.poll() is None:
        signalled.add(index)
        process.send_signal(signal.SIGTERM)

  previous_handlers = {signum: signal.signal(signum, pass_on)
                       for signum in (signal.SIGTERM, signal.SIGINT)}
  ended_at: dict[int, float] = {}
  try:
    while len(ended_at) < len(processes):
      now = time.monotonic()
      for index, process in enumerate(processes):
        if index not in ended_at and process.poll() is not None:
          ended_at[index] = now
      if passed_on_at and now - passed_on_at[0] > stop_grace_secs:
        running = [i for i, p in enumerate(processes) if p.poll() is None]
        with lock:
          print(f"[launch] process{'es' if len(running) > 1 else ''} "
                f"{', '.join(map(str, running))} did not stop within {stop_grace_secs:g}s "
                "(--stop_grace_secs) of the SIGTERM passed on: killing them", flush=True)
        for index in running:
          signalled.add(index)
          with contextlib.suppress(ProcessLookupError):
            os.killpg(processes[index].pid, signal.SIGKILL)  # With whatever it started.
        for process in processes:
          process.wait()
        break
      if ended_at:
        patience = (_PEERS_FAIL_SECS if any(_failed(p.returncode) for p in processes)
                    else _PEERS_END_SECS)
        if now - min(ended_at.values()) > patience:
          with lock:
            print(f"[launch] processes still running {patience:g}s after one ended; "
                  "stopping them", flush=True)
          _stop(processes, signalled)
          break
      time.sleep(0.05)
  finally:
    for signum, handler in previous_handlers.items():
      signal.signal(signum, handler)
  for index in range(len(processes)):
    ended_at.setdefault(index, time.monotonic())
  for relay in relays:  # Their last lines may name the failed process.
    relay.join(timeout=5)
  exit_code, blamed = _run_exit_code(processes, ended_at, tuple(named_failures), signalled)
  with lock:
    print("[launch] exit codes: " + ", ".join(
        f"process {i}: {p.returncode}" for i, p in enumerate(processes)), flush=True)
    if blamed is not None:
      print(f"[launch] process {blamed} failed with exit code {exit_code}", flush=True)
  return exit_code


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxline_ng.launch", description=__doc__.splitlines()[0],
      usage="%(prog)s [--num_processes N] [--devices_per_process D] -- COMMAND ...")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=2)
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: pick a free one)")
  parser.add_argument("--stop_grace_secs", type=float, default=DEFAULT_STOP_GRACE_SECS,
                      help="after passing a SIGTERM or Ctrl-C on, kill processes still running "
                      "this much later")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after --")
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  if not args.stop_grace_secs > 0:
    parser.error(f"--stop_grace_secs={args.stop_grace_secs:g} must be positive")
  if args.port and not 0 < args.port < 65536:
    parser.error(f"--port={args.port} is not a port (1-65535, or 0 to pick a free one)")
  if args.port and port_in_use(args.port):
    # A process given a live run's coordinator ends that run (JAX aborts
    # every process of it), so the port is checked before any starts.
    parser.error(f"--port={args.port} is in use on this host (another run's coordinator?): "
                 "give another, or 0 to pick a free one")
  if shutil.which(command[0]) is None:
    parser.error(f"the command's program {command[0]!r} is not found or not executable")
  code = launch(command, args.num_processes, args.devices_per_process, args.port,
                args.stop_grace_secs)
  return code if code >= 0 else 128 - code  # -9 (a SIGKILL) is 137, as shells say.


if __name__ == "__main__":
  sys.exit(main())
