"""The toy experiment, whose process 1 loses a race with checkpoint rotation once.

At its first restore of a checkpoint the chief chose, process 1 finds that
checkpoint gone and a newer one saved, as when a training job saves and
rotates its checkpoints out (`max_checkpoints_to_keep`) between the chief's
choice and the others' reads, once the others had a second to read it: it
moves the chosen step out of the series and the newer one the test held back
(`<checkpoint_dir>/saved_later/<step>`) into it.
"""

import functools
import os
import time

import jax
from absl import app, flags

from jaxline_ng import disk_checkpointing, platform
from tests.experiments import toy


class LosesTheFirstRace(disk_checkpointing.DiskCheckpointer):

  # Its restore ends in DiskCheckpointer's: it keeps what that one declares.
  keeps_run_entries = True
  restores_saved_entries = True
  restores_by_path = True
  lost = False

  def restore(self, ckpt_series, path=None):
    if path is not None and jax.process_index() == 1 and not self.lost:
      self.lost = True
      time.sleep(1)
      series_dir, step = os.path.split(path)
      checkpoint_dir = os.path.dirname(os.path.dirname(series_dir))
      os.rename(path, os.path.join(checkpoint_dir, f"rotated_out_{step}"))
      saved_later = os.path.join(checkpoint_dir, "saved_later")
      for newer in os.listdir(saved_later):
        os.rename(os.path.join(saved_later, newer), os.path.join(series_dir, newer))
    super().restore(ckpt_series, path=path)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(functools.partial(platform.main, toy.Experiment, checkpointer_factory=LosesTheFirstRace))
