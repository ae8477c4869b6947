"""Disk checkpoints at scale, measured against this machine's own limits.

    python -m benchmarks.checkpoint_io                 # 1 GiB state, then char_lm restarts
    python -m benchmarks.checkpoint_io --gib=0.01 --restarts=0   # a quick check

On 4 fake CPU devices, a mesh-mode state of `--gib` GiB of float32
parameters, sharded over the 4 devices, is saved `--saves` times and restored
by `DiskCheckpointer`. Reported, with the medians over saves:

- save: seconds from `save()` until the checkpoint is on disk (the save,
  then `os.sync()`), as throughput, beside writing one file of the same size
  sequentially and `fsync`ing it, in the same run and directory;
- restore: seconds of `restore()` (read, checksums verified, placed on the
  devices) with the checkpoint's pages dropped from the page cache first,
  beside reading the file back after dropping its pages too;
- stall: how long `save()` holds the training thread, beside a device->host
  copy of the same state (`jax.device_get`);
- peak host memory: the largest rise of this process's resident memory
  above its level before the save, sampled every 2 ms while the save runs;
- restart: `--restarts` pairs of char_lm (`:tiny`, 1 process x 4 devices)
  restarts from the same checkpoint, each running one step, with a cold
  (empty) and a warm (populated) compilation cache: seconds from process
  start to the end of that first step. JAX's default threshold applies
  (programs that compiled in >= 1 s are cached).

Prints a JSON summary and writes it to `--out`.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
CHAR_LM = os.path.join("examples", "char_lm", "experiment.py")


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakMemory:
  """Samples this process's resident memory on a thread until stopped."""

  def __init__(self):
    self.baseline = _rss_bytes()
    self.peak = self.baseline
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, _rss_bytes())

  def stop(self) -> int:
    self._stop.set()
    self._thread.join()
    return self.peak - self.baseline


def _drop_from_page_cache(path: str) -> None:
  """Evicts a file's (or a tree's) pages, so the next read comes from the disk."""
  os.sync()
  paths = [path] if os.path.isfile(path) else [
      os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
  for p in paths:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def sequential_file(directory: str, size: int) -> dict:
  """Seconds to write `size` bytes to one file and fsync it, then to read them back cold."""
  chunk = os.urandom(64 << 20)
  path = os.path.join(directory, "sequential.bin")
  start = time.perf_counter()
  with open(path, "wb", buffering=0) as f:
    written = 0
    while written < size:
      written += f.write(chunk[:min(len(chunk), size - written)])
    os.fsync(f.fileno())
  write_s = time.perf_counter() - start
  _drop_from_page_cache(path)
  start = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    while f.read(64 << 20):
      pass
  read_s = time.perf_counter() - start
  os.remove(path)
  return {"write_s": write_s, "read_s": read_s}


def state_io(gib: float, saves: int, directory: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxline_ng import base_config, disk_checkpointing, experiment, mesh  # pylint: disable=import-outside-toplevel

  leaves = 16
  rows = max(DEVICES, int(gib * (1 << 30) / 4 / leaves / 1024) // DEVICES * DEVICES)

  class Big(experiment.AbstractExperiment):
    CHECKPOINT_ATTRS = {"_params": "params"}

    def __init__(self, mode, init_rng=None):
      super().__init__(mode, init_rng)
      values = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
      self._params = {f"layer_{i}": mesh.place(values + i, "model") for i in range(leaves)}

    def step(self, **unused):
      return {}

    def evaluate(self, **unused):
      return {}

  config = base_config.get_base_config()
  config.placement, config.mesh_shape = "mesh", "model:-1"
  config.checkpointer, config.max_checkpoints_to_keep = "disk", 2
  config.checkpoint_dir = directory
  mesh.activate(config)

  def new_state():
    checkpointer = disk_checkpointing.DiskCheckpointer(config, "train")
    state = checkpointer.get_experiment_state("latest")
    state.experiment_module = Big("train")
    state.train_step_rng = mesh.placement().replicate(jax.random.PRNGKey(0))
    return checkpointer, state

  checkpointer, state = new_state()
  size = sum(x.nbytes for x in state.experiment_module._params.values())  # pylint: disable=protected-access
  jax.block_until_ready(state.experiment_module._params)  # pylint: disable=protected-access
  copies, stalls, totals, peaks = [], [], [], []
  for index in range(saves):
    start = time.perf_counter()
    # A copy into new host memory: on CPU devices `device_get` alone may alias device buffers.
    [np.array(x) for x in jax.device_get(state.experiment_module._params).values()]  # pylint: disable=protected-access,expression-not-assigned
    copies.append(time.perf_counter() - start)
    state.global_step = index + 1
    memory = _PeakMemory()
    start = time.perf_counter()
    checkpointer.save("latest")
    stalls.append(time.perf_counter() - start)
    checkpointer.wait_for_checkpointing_to_finish()
    os.sync()
    totals.append(time.perf_counter() - start)
    peaks.append(memory.stop())
  restores = []
  for _ in range(saves):
    restorer, restored = new_state()
    _drop_from_page_cache(os.path.join(directory, "checkpoints"))
    start = time.perf_counter()
    restorer.restore("latest")
    jax.block_until_ready(restored.experiment_module._params)  # pylint: disable=protected-access
    restores.append(time.perf_counter() - start)
    assert restored.global_step == saves
  sequential = sequential_file(directory, size)
  save_s, restore_s = statistics.median(totals), statistics.median(restores)
  gib_size = size / (1 << 30)
  return {
      "state_gib": gib_size, "arrays": leaves, "devices": jax.device_count(),
      "save_s": save_s, "save_gib_per_s": gib_size / save_s,
      "file_write_fsync_s": sequential["write_s"],
      "file_write_gib_per_s": gib_size / sequential["write_s"],
      "save_vs_file_write": sequential["write_s"] / save_s,
      "restore_s": restore_s, "restore_gib_per_s": gib_size / restore_s,
      "file_read_cold_s": sequential["read_s"],
      "file_read_gib_per_s": gib_size / sequential["read_s"],
      "restore_vs_file_read": sequential["read_s"] / restore_s,
      "stall_ms": 1e3 * statistics.median(stalls),
      "device_to_host_copy_ms": 1e3 * statistics.median(copies),
      "stall_vs_copy": statistics.median(stalls) / statistics.median(copies),
      "peak_host_memory_gib": max(peaks) / (1 << 30),
      "peak_host_memory_vs_state": max(peaks) / size,
  }


def _first_step_seconds(run_dir: str, cache_dir: str) -> float:
  """Seconds from starting a char_lm restart until its one step is done."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
  command = [sys.executable, CHAR_LM, f"--config={CHAR_LM}:tiny", "--config.checkpointer=disk",
             f"--config.checkpoint_dir={run_dir}", f"--config.compilation_cache_dir={cache_dir}",
             "--config.training_steps=3"]
  start = time.perf_counter()
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  elapsed = None
  for line in process.stderr:
    if elapsed is None and "step 3/3" in line:
      elapsed = time.perf_counter() - start
  if process.wait(timeout=600) != 0 or elapsed is None:
    raise RuntimeError(f"char_lm restart failed (exit {process.returncode})")
  return elapsed


def restarts(pairs: int, directory: str) -> dict:
  """char_lm restarts from one checkpoint at step 2, cold and warm cache, alternating."""
  seed_dir, warm_cache = os.path.join(directory, "seed"), os.path.join(directory, "warm_cache")
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  subprocess.run([sys.executable, CHAR_LM, f"--config={CHAR_LM}:tiny",
                  "--config.checkpointer=disk", f"--config.checkpoint_dir={seed_dir}",
                  f"--config.compilation_cache_dir={warm_cache}", "--config.training_steps=2"],
                 cwd=ROOT, env=env, capture_output=True, check=True, timeout=600)
  # One restart fills the warm cache with what restoring compiles too.
  shutil.copytree(seed_dir, os.path.join(directory, "fill"))
  _first_step_seconds(os.path.join(directory, "fill"), warm_cache)
  cold, warm = [], []
  for index in range(2 * pairs):
    run_dir = os.path.join(directory, f"run_{index}")
    shutil.copytree(seed_dir, run_dir)
    if index % 2 == 0:
      cold.append(_first_step_seconds(run_dir, os.path.join(directory, f"cold_cache_{index}")))
    else:
      warm.append(_first_step_seconds(run_dir, warm_cache))
  return {"restart_cold_s": statistics.median(cold), "restart_warm_s": statistics.median(warm),
          "restart_cold_runs": cold, "restart_warm_runs": warm, "processes": 1,
          "devices": DEVICES}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gib", type=float, default=1.0)
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--restarts", type=int, default=3, help="cold/warm pairs; 0 skips")
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  parser.add_argument("--out", default=None, help="also write the JSON here")
  args = parser.parse_args()
  directory = tempfile.mkdtemp(prefix="jaxline_ng_ckpt_io_", dir=args.dir)
  try:
    results = {"command": " ".join(["python -m benchmarks.checkpoint_io", *sys.argv[1:]])}
    results.update(state_io(args.gib, args.saves, os.path.join(directory, "state")))
    if args.restarts:
      results.update(restarts(args.restarts, os.path.join(directory, "restarts")))
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  text = json.dumps(results, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
