"""Kills a training process with SIGKILL at random moments while it saves, then checks
that the newest complete checkpoint always loads.

    python -m benchmarks.kill_during_save --kills=20

Each round starts (or resumes) the toy experiment with the disk checkpointer
saving every step, waits a random 0.5-3 s after its first save, kills it with
SIGKILL, then loads the newest complete checkpoint of `latest` the way a
restart would. Prints one line per round and a summary; exits non-zero if any
round leaves no loadable checkpoint.
"""

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(ROOT, "tests", "experiments", "toy.py")
DIM = 100_000


def newest_loadable_step(checkpoint_dir: str) -> int:
  """Restores `latest` as a restarting run would; returns its step."""
  sys.path.insert(0, os.path.dirname(TOY))
  import toy  # pylint: disable=import-outside-toplevel

  from jaxline_ng import disk_checkpointing  # pylint: disable=import-outside-toplevel
  config = toy.get_config()
  config.checkpointer = "disk"
  config.checkpoint_dir = checkpoint_dir
  config.experiment_kwargs.config.dim = DIM  # As the killed runs had it: restore checks shapes.
  checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
  state = checkpointer.get_experiment_state("latest")
  state.experiment_module = toy.Experiment("train", None, **config.experiment_kwargs)
  checkpointer.restore("latest")
  return state.global_step


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  workdir = tempfile.mkdtemp(prefix="jaxline_ng_kill_")
  xla_flags = os.environ.get("XLA_FLAGS", "")  # Kept: the test suite compiles faster.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=f"{xla_flags} --xla_force_host_platform_device_count=4")
  command = [sys.executable, TOY, f"--config={TOY}", f"--config.checkpoint_dir={workdir}",
             "--config.checkpointer=disk", "--config.training_steps=100000000",
             "--config.save_checkpoint_interval=1", "--config.log_train_data_interval=1000000000",
             f"--config.experiment_kwargs.config.dim={DIM}"]
  series = os.path.join(workdir, "checkpoints", "latest")
  loaded = 0
  try:
    for round_index in range(args.kills):
      process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
      for line in process.stderr:  # Wait for the run's first save of this round.
        if "Saved checkpoint latest" in line:
          break
      time.sleep(rng.uniform(0.5, 3.0))
      process.kill()
      process.wait()
      try:
        step = newest_loadable_step(workdir)
        loaded += 1
        partial = [n for n in os.listdir(series) if not n.isdigit()]
        print(f"round {round_index + 1}: killed; newest complete checkpoint (step {step}) "
              f"loads; {len(partial)} partial save(s) left for the next start to clean",
              flush=True)
      except Exception as e:  # pylint: disable=broad-except  (reported as the failure)
        print(f"round {round_index + 1}: NO LOADABLE CHECKPOINT: {e}", flush=True)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  print(f"{loaded}/{args.kills} kills left a loadable checkpoint")
  return 0 if loaded == args.kills else 1


if __name__ == "__main__":
  sys.exit(main())
