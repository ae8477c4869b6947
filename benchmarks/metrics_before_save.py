"""What making metrics durable before each checkpoint costs a save.

    python -m benchmarks.metrics_before_save [--steps=400] [--save_every=10]

Trains the toy experiment in this process on 4 fake CPU devices with the
disk checkpointer, writing every step's scalars to TensorBoard and JSONL,
and times each `loop_actions.flush_metrics` (the wait for the due rows and the
writer's flush that precedes every durable save). Prints the count,
median, 90th percentile and maximum in milliseconds.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--save_every", type=int, default=10)
  args = parser.parse_args()

  sys.path.insert(0, os.path.join(ROOT, "tests", "experiments"))
  import toy  # pylint: disable=import-outside-toplevel

  from jaxline_ng import disk_checkpointing, loop_actions, train, writers  # pylint: disable=import-outside-toplevel

  timings = []
  flush = loop_actions.flush_metrics  # pylint: disable=protected-access

  def timed_flush(*flush_args):
    start = time.perf_counter()
    flush(*flush_args)
    timings.append(time.perf_counter() - start)

  loop_actions.flush_metrics = timed_flush  # pylint: disable=protected-access
  with tempfile.TemporaryDirectory() as checkpoint_dir:
    config = toy.get_config()
    config.checkpoint_dir = checkpoint_dir
    config.checkpointer = "disk"
    config.training_steps = args.steps
    config.save_checkpoint_interval = args.save_every
    config.log_train_data_interval = 1
    config.log_tensors_interval = 100
    writer = writers.make_writer(os.path.join(checkpoint_dir, "train"))
    start = time.perf_counter()
    try:
      train.train(toy.Experiment, config,
                  disk_checkpointing.DiskCheckpointer(config, "train"), writer)
    finally:
      writer.close()
    elapsed = time.perf_counter() - start
  ms = sorted(t * 1e3 for t in timings)
  print(f"{len(ms)} saves in {elapsed:.1f}s ({args.steps / elapsed:.0f} steps/s); metrics flush "
        f"before a save: median {statistics.median(ms):.2f} ms, "
        f"p90 {ms[int(0.9 * (len(ms) - 1))]:.2f} ms, max {ms[-1]:.2f} ms")


if __name__ == "__main__":
  main()
