"""Starts a multi-process run on this machine, over loopback.

    python -m jaxline_ng.launch --num_processes=2 --devices_per_process=2 -- \
        python examples/digits/experiment.py --config=examples/digits/experiment.py

Each process gets `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` (which `platform.main` reads to start JAX's distributed
runtime) and `devices_per_process` fake CPU devices. Their output is
interleaved line by line, each line prefixed `[p<i>]`. When a process fails,
the others are stopped and the launcher exits with the failed process's exit
code; it exits 0 when every process does.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# How long stopped processes get to exit on SIGTERM before SIGKILL. Short: a
# process whose peer died may wait on a collective that will never complete.
_STOP_GRACE_SECS = 5.0


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _relay(stream, prefix: str, out, lock: threading.Lock) -> None:
  for line in stream:
    with lock:
      out.write(f"{prefix} {line}")
      out.flush()


def _stop(processes) -> None:
  for process in processes:
    if process.poll() is None:
      process.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + _STOP_GRACE_SECS
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


def _first_failure(processes) -> tuple[int, int] | None:
  """(index, exit code) of the failed process to blame, or None.

  When a process dies, JAX's coordination service aborts its peers within
  milliseconds, so several may have ended by one poll. An error exit (code > 0)
  is the cause; deaths by signal (code < 0) are taken as its consequence.
  """
  failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode not in (None, 0)]
  if not failed:
    return None
  return min(failed, key=lambda failure: (failure[1] < 0, failure[0]))


def launch(command: list[str], num_processes: int, devices_per_process: int,
           port: int = 0) -> int:
  """Runs `command` as `num_processes` processes; returns the run's exit code."""
  address = f"127.0.0.1:{port or _free_port()}"
  lock = threading.Lock()
  processes, relays = [], []
  for index in range(num_processes):
    env = dict(os.environ,
               JAX_COORDINATOR_ADDRESS=address,
               JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(index),
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={devices_per_process}"))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    processes.append(process)
    relay = threading.Thread(target=_relay, args=(process.stdout, f"[p{index}]", sys.stdout, lock),
                             daemon=True)
    relay.start()
    relays.append(relay)

  exit_code = 0
  try:
    while _first_failure(processes) is None:
      running = [p for p in processes if p.poll() is None]  # Polls every process.
      if not running:
        break
      time.sleep(0.05)
    failure = _first_failure(processes)
    if failure is not None:
      index, exit_code = failure
      with lock:
        print(f"[launch] process {index} failed with exit code {exit_code}; "
              "stopping the others", flush=True)
      _stop(processes)
  except KeyboardInterrupt:
    _stop(processes)
    exit_code = 130
  for relay in relays:
    relay.join(timeout=5)
  return exit_code


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxline_ng.launch", description=__doc__.splitlines()[0],
      usage="%(prog)s [--num_processes N] [--devices_per_process D] -- COMMAND ...")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=2)
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: pick a free one)")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after --")
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  return launch(command, args.num_processes, args.devices_per_process, args.port)


if __name__ == "__main__":
  sys.exit(main())
