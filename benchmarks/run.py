"""jaxline_ng's benchmarks: what the framework costs next to a hand-written loop.

    python -m benchmarks.run                 # full run, ~5 minutes on 2 CPU cores
    python -m benchmarks.run --smoke         # a few steps of each, in one process (the suite's)

Every measurement runs in worker processes on 4 fake CPU devices. A paired
comparison runs A and B alternately inside each worker (A B, B A, ...;
`--rounds` pairs per worker, `--processes` workers), each run timing
`--steps` steps after a warmup; it reports the median of the per-pair
ratios, a 90% bootstrap confidence interval of that median, and the
quartiles of the ratios. On this machine identical runs differ by +-10 %
whatever their length (an A/A comparison of the hand-written loop had the
same interquartile range, 0.92-1.08, with runs of 250, 1,000 and 4,000
steps), so the precision comes from the number of pairs: many short runs
(300 steps) rather than a few long ones.
Prints a table and writes it as JSON (`--out`).

- loop: steps/s of the same pmapped MLP update driven by a hand-written loop
  under the framework's contract (replicated state; each step a fresh
  per-device key split from a kept chain by one jitted call, then one pmap
  call; scalars fetched every 100 steps) and by `jaxline_ng.train` (progress
  logged every 100 steps). Ratio = framework / hand. Both import jaxline_ng,
  so both run with the XLA CPU thread pool it sizes (`jaxline_ng/xla_cpu.py`).
- loop_mesh: the same in mesh mode: a hand-written `jax.jit` loop over global
  arrays (batch sharded over `data`) vs `jaxline_ng.train` with
  `placement="mesh"`.
- noise: the hand-written pmap loop against itself, paired the same way. It
  reads 1 up to the machine's noise: its confidence interval is how far
  apart two identical loops can measure, the floor under every other ratio.
- digits: the digits example's ConvNet under `jaxline_ng.train` vs a
  hand-written loop calling its update (`benchmarks/digits.py`).
- overhead: the framework's own time per step, timed around a step that
  does no device work (the loop's bookkeeping alone), as a share of the
  hand-written loop's step time. Unlike the ratios, it does not drown in
  this machine's run-to-run noise (+-15 %).
- logging: `jaxline_ng.train` writing scalars every step (TensorBoard + JSONL,
  asynchronously) vs not writing, in steady state: the writer has imported
  TensorFlow (a one-time cost of seconds, on its own thread) before the
  timed steps. Ratio = logging / none.
- checkpoint: in-memory checkpoint every 10 steps vs none. Ratio likewise.
- save_stall: how long one disk save holds up the training thread, next to
  the time to copy the same state device -> host.
- startup: seconds from process start to the first step, less `import jax`,
  the experiment's own construction, and compiling the step.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4


# --- Workers: each runs in a fresh process and prints one JSON line. ---

def _timed_steps(warmup: int, steps: int):
  """A periodic action that times steps warmup..warmup+steps, blocking at both ends."""
  import jax  # pylint: disable=import-outside-toplevel
  marks = {}

  def action(t, step, scalars):
    if step in (warmup, warmup + steps):
      jax.block_until_ready(scalars)
      marks[step] = time.perf_counter()

  action.update_time = lambda t, step: None
  action.finish = action.wait_to_finish = lambda: None
  return action, lambda: steps / (marks[warmup + steps] - marks[warmup])


def _update(params, opt_state, batch, step_key):
  """The hand-written pmap loop's step: the workload's update with the step's key."""
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  return workloads.update(params, opt_state, batch, step_key)


def _update_global(params, opt_state, batch, step_key):
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  return workloads.update_global(params, opt_state, batch, step_key)


def _per_device_step_keys(chain):
  """jaxline's contract, written by hand: split the replicated chain, fold each
  device's position into its step key."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  children = jax.vmap(jax.random.split)(chain)
  step_keys = jax.vmap(jax.random.fold_in)(children[:, 0], jnp.arange(chain.shape[0]))
  return step_keys, children[:, 1]


def _global_step_key(chain):
  import jax  # pylint: disable=import-outside-toplevel
  step_key, next_chain = jax.random.split(chain)
  return step_key, next_chain


def _hand_loop(update, next_keys, params, opt_state, batch, chain, warmup: int, steps: int,
               fetch_loss) -> dict:
  """Under the framework's contract: each step gets a fresh key from outside
  its update (one jitted split of the chain, then one pmap/jit call); the
  loss fetched every 100 steps; steps/s after warmup."""
  import jax  # pylint: disable=import-outside-toplevel
  start = None
  for step in range(1, warmup + steps + 1):
    step_key, chain = next_keys(chain)
    params, opt_state, loss = update(params, opt_state, batch, step_key)
    if step % 100 == 0:
      fetch_loss(loss)
    if step == warmup:
      jax.block_until_ready(loss)
      start = time.perf_counter()
  jax.block_until_ready(loss)
  return {"steps_per_sec": steps / (time.perf_counter() - start)}


def worker_hand(warmup: int, steps: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  from jaxline_ng import utils  # pylint: disable=import-outside-toplevel
  update = jax.pmap(_update, axis_name="i", donate_argnums=(0, 1))
  params, opt_state = workloads.initial_state()
  return _hand_loop(update, jax.jit(_per_device_step_keys), utils.bcast_local_devices(params),
                    utils.bcast_local_devices(opt_state), workloads.device_batch(),
                    utils.bcast_local_devices(jax.random.PRNGKey(0)),
                    warmup, steps, lambda loss: float(loss.addressable_shards[0].data[0]))


def worker_hand_jit(warmup: int, steps: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  from jaxline_ng import base_config, mesh  # pylint: disable=import-outside-toplevel
  config = base_config.get_base_config()
  config.placement = "mesh"
  mesh.activate(config)
  update = jax.jit(_update_global, donate_argnums=(0, 1))
  params, opt_state = mesh.replicate(workloads.initial_state())
  return _hand_loop(update, jax.jit(_global_step_key), params, opt_state,
                    workloads.global_batch(), mesh.replicate(jax.random.PRNGKey(0)), warmup,
                    steps, float)


def worker_framework(warmup: int, steps: int, write_every_step: bool,
                     checkpoint_every: int, placement: str = "pmap",
                     overrides: dict | None = None) -> dict:
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  from jaxline_ng import base_config, checkpointing, train, writers  # pylint: disable=import-outside-toplevel
  config = base_config.get_base_config()
  config.placement = placement
  config.training_steps = warmup + steps
  config.interval_type = "steps"
  config.log_tensors_interval = 100
  config.log_train_data_interval = 1 if write_every_step else None
  config.save_checkpoint_interval = checkpoint_every or 10**9
  with tempfile.TemporaryDirectory(prefix="jaxline_ng_bench_") as checkpoint_dir:
    config.checkpoint_dir = checkpoint_dir
    config.update(overrides or {})
    writer = None
    if write_every_step:
      # A smoke run leaves TensorFlow's import (seconds of the suite's CPU) to the writer's tests.
      writer = writers.make_writer(os.path.join(config.checkpoint_dir, "train"),
                                   tensorboard=not _IN_PROCESS)
      # Steady state: TensorFlow's one-time import (seconds of one core, on the
      # writer's thread, while a real run starts up) is not part of the ratio.
      writer.flush()
    timer, steps_per_sec = _timed_steps(warmup, steps)
    experiment_class = (workloads.MeshMLPExperiment if placement == "mesh"
                        else workloads.MLPExperiment)
    train.train(experiment_class, config,
                checkpointing.InMemoryCheckpointer(config, "train"), writer, [timer])
    if writer is not None:
      writer.close()
  return {"steps_per_sec": steps_per_sec()}


def worker_overhead(steps: int) -> dict:
  """The framework's own time per step: the loop around a step that does no work.

  The step returns a ready device scalar, so what is timed is the loop's
  bookkeeping (step inputs, periodic actions, the non-finite guard), not
  the device.
  """
  import jax  # pylint: disable=import-outside-toplevel

  from jaxline_ng import base_config, checkpointing, experiment, train  # pylint: disable=import-outside-toplevel

  class NoWork(experiment.AbstractExperiment):

    def __init__(self, mode, init_rng):
      super().__init__(mode, init_rng)
      self._loss = jax.device_put(0.5)

    def step(self, global_step, rng, writer):
      return {"loss": self._loss}

    def evaluate(self, global_step, rng, writer):
      return {}

  config = base_config.get_base_config()
  config.training_steps = steps
  config.interval_type = "steps"
  config.log_tensors_interval = 100
  config.log_train_data_interval = None
  config.save_checkpoint_interval = 10**9
  timer, steps_per_sec = _timed_steps(steps // 10, steps - steps // 10)
  train.train(NoWork, config, checkpointing.InMemoryCheckpointer(config, "train"), None, [timer])
  return {"us_per_step": 1e6 / steps_per_sec()}


def worker_save_stall(saves: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  from jaxline_ng import base_config, checkpointing, disk_checkpointing, mesh  # pylint: disable=import-outside-toplevel
  results = {}
  for kind in ("memory", "disk"):
    with tempfile.TemporaryDirectory(prefix="jaxline_ng_bench_") as checkpoint_dir:
      config = base_config.get_base_config()
      config.checkpoint_dir = checkpoint_dir
      checkpointer = (disk_checkpointing.DiskCheckpointer(config, "train") if kind == "disk"
                      else checkpointing.InMemoryCheckpointer(config, "train"))
      state = checkpointer.get_experiment_state("latest")
      state.experiment_module = workloads.MLPExperiment("train", None)
      state.train_step_rng = mesh.placement().replicate(jax.random.PRNGKey(0))
      stalls, copies = [], []
      for index in range(saves):
        state.global_step = index + 1
        module = state.experiment_module
        module.step(global_step=None, rng=state.train_step_rng, writer=None)
        jax.block_until_ready((module._params, module._opt_state))  # pylint: disable=protected-access
        start = time.perf_counter()
        jax.device_get((state.train_step_rng, module.snapshot_state()))
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        checkpointer.save("latest")
        stalls.append(time.perf_counter() - start)
        # Training steps between saves: the save finishes in the background.
        checkpointer.wait_for_checkpointing_to_finish()
      checkpointer.wait_for_checkpointing_to_finish()
      results[kind] = {"stall_ms": 1e3 * statistics.median(stalls),
                       "copy_ms": 1e3 * statistics.median(copies)}
  return results


def worker_startup() -> dict:
  # The parent records when it started this process; see _run_worker.
  process_start = float(os.environ.get("JAXLINE_NG_BENCH_T0", time.time()))
  before_jax = time.time()
  import jax  # pylint: disable=import-outside-toplevel
  jax_import = time.time() - before_jax
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel  (user code)
  before_framework = time.time()
  # platform is imported for its cost: every command-line run pays it.
  from jaxline_ng import base_config, checkpointing, platform, train  # pylint: disable=import-outside-toplevel
  framework_import = time.time() - before_framework
  del platform
  marks = {}

  class Timed(workloads.MLPExperiment):

    def __init__(self, mode, init_rng):
      start = time.time()
      super().__init__(mode, init_rng)
      marks["init"] = time.time() - start

    def step(self, global_step, rng, writer):
      marks.setdefault("first_step", time.time())
      return super().step(global_step, rng, writer)

  config = base_config.get_base_config()
  config.training_steps = 2
  with tempfile.TemporaryDirectory(prefix="jaxline_ng_bench_") as checkpoint_dir:
    config.checkpoint_dir = checkpoint_dir
    train_start = time.time()
    train.train(Timed, config, checkpointing.InMemoryCheckpointer(config, "train"), None)
  framework_in_train = marks["first_step"] - train_start - marks["init"]
  return {"to_first_step_s": marks["first_step"] - process_start, "jax_import_s": jax_import,
          "jax_version": jax.__version__,
          "framework_import_s": framework_import, "framework_train_setup_s": framework_in_train,
          "experiment_init_s": marks["init"], "framework_s": framework_import + framework_in_train}


_IN_PROCESS = []  # Set by --smoke: run workers here, to exercise the code quickly.


def _run_in_process(name: str, kwargs: dict) -> dict:
  from jaxline_ng import utils  # pylint: disable=import-outside-toplevel
  utils.GLOBAL_CHECKPOINT_DICT.clear()  # As in a fresh process: nothing to resume.
  return WORKERS[name](**kwargs)


def _run_worker(name: str, **kwargs) -> dict:
  """Runs worker `name` in a fresh process (in-process for smoke runs).

  `PJRT_NPROC` is not passed on: every worker imports jaxline_ng, which
  sizes XLA's CPU pool as a user's run gets it.
  """
  if _IN_PROCESS:
    return _run_in_process(name, kwargs)
  env = {name: value for name, value in os.environ.items() if name != "PJRT_NPROC"}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, JAXLINE_NG_BENCH_T0=repr(time.time()))
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.run", "--worker", name, "--kwargs", json.dumps(kwargs)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  if result.returncode != 0:
    raise RuntimeError(f"benchmark worker {name} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def worker_interleaved(a: list, b: list, rounds: int) -> dict:
  """Runs A and B alternately in this process, `rounds` times each; their steps/s.

  The order flips every round (A B, B A, ...), so neither side always runs
  first after the other. Both are compiled by their first run; later runs
  hit the compile cache, and every run times only the steps after its warmup.
  """
  pairs = []
  for index in range(rounds):
    rates = {}
    for side, (name, kwargs) in (("a", a), ("b", b))[::1 if index % 2 == 0 else -1]:
      rates[side] = _run_in_process(name, kwargs)["steps_per_sec"]
    pairs.append([rates["a"], rates["b"]])
  return {"pairs": pairs}


def worker_digits_hand(warmup: int, steps: int) -> dict:
  from benchmarks import digits  # pylint: disable=import-outside-toplevel
  return digits.hand(warmup, steps, _per_device_step_keys)


def worker_digits_framework(warmup: int, steps: int) -> dict:
  from benchmarks import digits  # pylint: disable=import-outside-toplevel
  return digits.framework(warmup, steps, _timed_steps)


WORKERS = {"hand": worker_hand, "hand_jit": worker_hand_jit, "framework": worker_framework,
           "digits_hand": worker_digits_hand, "digits_framework": worker_digits_framework,
           "interleaved": worker_interleaved, "overhead": worker_overhead,
           "save_stall": worker_save_stall, "startup": worker_startup}


def _median_ci(ratios: list[float], level: float = 0.9, resamples: int = 2000) -> tuple:
  """A bootstrap `level` confidence interval of the median of `ratios`.

  Pairs are resampled with replacement; the seed is fixed so a results
  file always prints the same interval.
  """
  if len(ratios) < 2:
    return ratios[0], ratios[0]
  draw = random.Random(0)
  medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios)))
                   for _ in range(resamples))
  tail = int(resamples * (1 - level) / 2)
  return medians[tail], medians[-tail - 1]


def _paired(processes: int, rounds: int, a: tuple[str, dict], b: tuple[str, dict]) -> dict:
  """Ratio of B's steps/s to A's over `processes` x `rounds` interleaved pairs.

  This machine's speed drifts by +-15 % from one second to the next; pairs of
  runs a second apart, in one process, see the same drift, so their ratio
  is much steadier than that of runs in separate processes.
  """
  pairs = []
  for _ in range(processes):
    pairs += _run_worker("interleaved", a=list(a), b=list(b), rounds=rounds)["pairs"]
  ratios = sorted(b_rate / a_rate for a_rate, b_rate in pairs)
  quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
  ci_low, ci_high = _median_ci(ratios)
  return {"ratio_median": statistics.median(ratios), "ratio_ci90": [ci_low, ci_high],
          "ratio_min": ratios[0],
          "ratio_max": ratios[-1], "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
          "a_steps_per_sec_median": statistics.median(a for a, _ in pairs),
          "b_steps_per_sec_median": statistics.median(b for _, b in pairs),
          "pairs": len(pairs), "steps_per_sec": [[round(a), round(b)] for a, b in pairs]}


def _ratio_cells(result: dict) -> tuple[str, str, str]:
  """Table cells of a paired ratio: median, its 90% CI, quartiles."""
  low, high = result["ratio_ci90"]
  return (f"{result['ratio_median']:.3f}", f"[{low:.3f}, {high:.3f}]",
          f"[{result['ratio_q1']:.3f}, {result['ratio_q3']:.3f}]")


def _slowdown_cells(result: dict) -> tuple[str, str, str]:
  """Table cells of a paired ratio read as a slowdown, 1 - ratio, in percent."""
  low, high = result["ratio_ci90"]
  return (f"{100 * (1 - result['ratio_median']):.1f}%",
          f"[{100 * (1 - high):.1f}, {100 * (1 - low):.1f}]%",
          f"[{100 * (1 - result['ratio_q3']):.1f}, {100 * (1 - result['ratio_q1']):.1f}]%")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few steps of each benchmark")
  parser.add_argument("--processes", type=int, default=3,
                      help="worker processes per comparison")
  parser.add_argument("--rounds", type=int, default=16,
                      help="interleaved A/B pairs per worker process")
  parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
  parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results.json"))
  parser.add_argument("--only", default="",
                      help="comma-separated subset of: loop,loop_mesh,noise,digits,overhead,"
                           "logging,checkpoint,save_stall,startup (prints JSON, not the table)")
  parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
  parser.add_argument("--kwargs", default="{}", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    print(json.dumps(WORKERS[args.worker](**json.loads(args.kwargs))))
    return 0

  if args.smoke:
    _IN_PROCESS.append(True)
  processes, rounds, steps, warmup = ((1, 1, 20, 5) if args.smoke else
                                      (args.processes, args.rounds, args.steps, 50))
  timed = {"warmup": warmup, "steps": steps}
  framework = {"warmup": warmup, "steps": steps, "write_every_step": False,
               "checkpoint_every": 0}
  measurements = {
      "loop": lambda: _paired(processes, rounds, ("hand", {"warmup": warmup, "steps": steps}),
                              ("framework", framework)),
      "loop_mesh": lambda: _paired(
          processes, rounds, ("hand_jit", {"warmup": warmup, "steps": steps}),
          ("framework", {**framework, "placement": "mesh"})),
      "noise": lambda: _paired(processes, rounds, ("hand", {"warmup": warmup, "steps": steps}),
                               ("hand", {"warmup": warmup, "steps": steps})),
      "logging": lambda: _paired(processes, rounds, ("framework", framework),
                                 ("framework", {**framework, "write_every_step": True})),
      "checkpoint": lambda: _paired(processes, rounds, ("framework", framework),
                                    ("framework", {**framework, "checkpoint_every": 10})),
      "digits": lambda: _paired(processes, rounds, ("digits_hand", timed),
                                ("digits_framework", timed)),
      "overhead": lambda: _run_worker("overhead", steps=200 if args.smoke else 20000),
      "save_stall": lambda: _run_worker("save_stall", saves=3 if args.smoke else 10),
      "startup": lambda: _run_worker("startup"),
  }
  if args.only:
    unknown = set(args.only.split(",")) - set(measurements)
    if unknown:
      parser.error(f"--only: unknown benchmark(s) {sorted(unknown)}")
    print(json.dumps({name: measurements[name]() for name in args.only.split(",")}, indent=2))
    return 0
  results = {name: measure() for name, measure in measurements.items()}
  results["machine"] = {"cpus": os.cpu_count(), "devices": DEVICES, "smoke": args.smoke}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)

  loop, logging_, checkpoint = results["loop"], results["logging"], results["checkpoint"]
  loop_mesh, overhead, noise = results["loop_mesh"], results["overhead"], results["noise"]
  hand_step_us = 1e6 / loop["a_steps_per_sec_median"]
  stall, startup = results["save_stall"], results["startup"]
  rows = [
      ("loop: framework / hand-written steps/s", *_ratio_cells(loop), ">= 0.97"),
      ("loop, mesh mode: framework / hand-written jit", *_ratio_cells(loop_mesh), ">= 0.97"),
      ("noise: hand-written loop / itself (A/A)", *_ratio_cells(noise), "1 (control)"),
      ("digits ConvNet: framework / hand-written", *_ratio_cells(results["digits"]), ">= 0.99"),
      ("framework's own time per step", f"{overhead['us_per_step']:.0f} us", "",
       f"{100 * overhead['us_per_step'] / hand_step_us:.1f}% of a {hand_step_us:.0f} us step",
       "<= 3%"),
      ("logging every step: slowdown", *_slowdown_cells(logging_), "<= 3%"),
      ("in-memory checkpoint every 10 steps: slowdown", *_slowdown_cells(checkpoint), "<= 5%"),
      ("disk save stall / device->host copy",
       f"{stall['disk']['stall_ms'] / stall['disk']['copy_ms']:.2f}x", "",
       f"{stall['disk']['stall_ms']:.1f} ms vs {stall['disk']['copy_ms']:.1f} ms", "<= 1.5x"),
      ("in-memory save stall / device->host copy",
       f"{stall['memory']['stall_ms'] / stall['memory']['copy_ms']:.2f}x", "",
       f"{stall['memory']['stall_ms']:.1f} ms vs {stall['memory']['copy_ms']:.1f} ms", ""),
      ("framework start-up", f"{startup['framework_s']:.2f} s", "",
       f"first step at {startup['to_first_step_s']:.2f} s", "<= 0.5 s"),
  ]
  print(f"{'benchmark':46} {'median':>7}  {'90% CI':16} {'quartiles / detail':26} target")
  for name, value, interval, detail, target in rows:
    print(f"{name:46} {value:>7}  {interval:16} {detail:26} {target}")
  print(f"hand-written pmap loop: {loop['a_steps_per_sec_median']:.0f} steps/s, framework: "
        f"{loop['b_steps_per_sec_median']:.0f} steps/s; hand-written jit loop: "
        f"{loop_mesh['a_steps_per_sec_median']:.0f} steps/s, framework (mesh): "
        f"{loop_mesh['b_steps_per_sec_median']:.0f} steps/s "
        f"({loop['pairs']} pairs x {steps} steps, "
        f"{DEVICES} fake CPU devices)")
  print(f"results written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
