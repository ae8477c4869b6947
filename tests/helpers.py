"""What the tests share for running jaxline_ng as a user would: paths, command lines, one run.

Imported as `helpers`: pytest puts tests/ on sys.path (the directory has no
`__init__.py`), as does running a script in it. conftest.py sets the
environment before any test module imports this, so `ENV` carries it to every
process a test starts.
"""

import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Launched runs import the worktree's jaxline_ng, whatever is installed.
ENV = dict(os.environ, PYTHONPATH=ROOT)
EXPERIMENTS = os.path.join(ROOT, "tests", "experiments")
# Relative to ROOT, where runs start unless a test says otherwise.
TOY = os.path.join("tests", "experiments", "toy.py")


def toy_experiment():
  """Returns the toy experiment module, imported under the name its runs give it (`toy`)."""
  if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)
  return importlib.import_module("toy")


def toy_command(checkpoint_dir, *extra, script=TOY, config=TOY):
  """Returns the command line of a toy run with disk checkpoints.

  Args:
    checkpoint_dir: the run's `config.checkpoint_dir`.
    *extra: further flags, after the defaults so that they override them.
    script: the program run (another experiment file reading the toy's config).
    config: the `--config` argument.
  """
  return [sys.executable, script, f"--config={config}",
          f"--config.checkpoint_dir={checkpoint_dir}", "--config.checkpointer=disk", *extra]


def launch_command(command, *launcher_flags, processes=2, devices=2):
  """Returns the command line running `command` as a multi-process run under jaxline_ng.launch.

  Args:
    command: the command line each process runs.
    *launcher_flags: further flags of the launcher.
    processes: `--num_processes`.
    devices: `--devices_per_process` (fake CPU devices).
  """
  return [sys.executable, "-m", "jaxline_ng.launch", f"--num_processes={processes}",
          f"--devices_per_process={devices}", *launcher_flags, "--", *command]


def devices_env(count, env=None):
  """Returns `env` (default `ENV`) with `count` fake CPU devices (the last XLA flag counts)."""
  env = ENV if env is None else env
  return dict(env, XLA_FLAGS=f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count={count}")


def run(command, timeout=120, env=None, cwd=ROOT):
  """Runs `command` to its end; a hang fails the test at `timeout` seconds.

  Args:
    command: the command line.
    timeout: seconds before the run is killed and `subprocess.TimeoutExpired` raised.
    env: the environment, default `ENV`.
    cwd: the directory it runs in.

  Returns:
    The `subprocess.CompletedProcess`, its stdout and stderr as text.
  """
  return subprocess.run(command, cwd=cwd, env=ENV if env is None else env, capture_output=True,
                        text=True, timeout=timeout)


def read_jsonl(path):
  """Returns the rows of a JSON-lines file (a run's metrics.jsonl), in order."""
  with open(path) as f:
    return [json.loads(line) for line in f]


def running(pid):
  """Whether process `pid` runs: a zombie its parent has not reaped yet has ended."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False
