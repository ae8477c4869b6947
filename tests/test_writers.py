"""Tests for jaxline_ng.writers: what lands on disk, and on which thread."""

import glob
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import read_jsonl, run
from test_dropin import MinimalWriter

from jaxline_ng import errors, metric_files, writers


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter that can import jaxline_ng."""
  result = run([sys.executable, "-c", textwrap.dedent(code), *args], timeout=60)
  assert result.returncode == 0, result.stderr
  return result


def _read_events(logdir) -> list[tuple[int, str, str, np.ndarray]]:
  """(step, tag, plugin name, value) of every summary in `logdir`, in order."""
  import tensorflow as tf  # Imported once per test process, when needed.

  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        plugin = value.metadata.plugin_data.plugin_name
        events.append((event.step, value.tag, plugin, tf.make_ndarray(value.tensor)))
  return events


def _read_scalars(logdir) -> list[tuple[int, str, float]]:
  scalars = []
  for step, tag, plugin, value in _read_events(logdir):
    assert plugin == "scalars", tag
    scalars.append((step, tag, value.item()))
  return scalars


class _RecordingWriter:
  """Records what it receives and on which thread; can stall or fail."""

  def __init__(self, gate=None, fail_at_step=None):
    self.calls = []  # (method, step, values, thread)
    self.completed = 0
    self.closed = False
    self.entered = threading.Event()
    self.failed = threading.Event()
    self._gate = gate
    self._fail_at_step = fail_at_step

  def _record(self, method, step, values):
    self.entered.set()
    if self._gate is not None:
      self._gate.wait()
    if step == self._fail_at_step:
      self.failed.set()
      raise OSError("disk on fire")
    self.calls.append((method, step, values, threading.current_thread()))
    self.completed += 1

  def write_scalars(self, global_step, scalars):
    self._record("write_scalars", global_step, scalars)

  def write_images(self, global_step, images):
    self._record("write_images", global_step, images)

  def write_histograms(self, global_step, values):
    self._record("write_histograms", global_step, values)

  def write_texts(self, global_step, texts):
    self._record("write_texts", global_step, texts)

  def flush(self):
    self.calls.append(("flush", None, None, threading.current_thread()))

  def close(self):
    self.closed = True


def test_tensorflow_is_never_imported_on_the_calling_thread(tmp_path):
  """Importing the module imports no TensorFlow; the async writer imports it on its
  worker (at once, to be ready for the first write), the sync one at its first write."""
  _run_python(
      """
    import importlib.abc, sys, threading
    importers = []

    class RecordTensorFlowImport(importlib.abc.MetaPathFinder):
      # Records who imports TensorFlow, and refuses: its import costs seconds of CPU.
      def find_spec(self, name, path, target=None):
        if name == "tensorflow":
          importers.append(threading.current_thread().name)
          raise ImportError("refused by the test")
        return None

    sys.meta_path.insert(0, RecordTensorFlowImport())
    from jaxline_ng import writers
    assert not importers, "imported by the module"
    sync_writer = writers.make_writer(sys.argv[1] + "/sync", use_async=False)
    assert not importers, "imported by constructing a sync writer"
    try:
      writers.make_writer(sys.argv[1] + "/async").close()
    except writers.WriterError as e:
      assert "refused by the test" in str(e), e
    assert importers and threading.main_thread().name not in importers, importers
    sync_writer.close()
    """,
      str(tmp_path),
  )


def test_tensorboard_scalars_round_trip_exactly(tmp_path):
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer.write_scalars(0, {"loss": 0.5, "score/eval": np.float32(0.25), "n": 3})
  on_device = {
      "loss": jnp.asarray(0.125),
      "score/eval": jnp.asarray([1.5]),
      "n": np.int64(4),
  }
  writer.write_scalars(7, on_device)
  writer.close()
  assert _read_scalars(tmp_path) == [
      (0, "loss", 0.5),
      (0, "score/eval", 0.25),
      (0, "n", 3.0),
      (7, "loss", 0.125),
      (7, "score/eval", 1.5),
      (7, "n", 4.0),
  ]
  with pytest.raises(ValueError, match="closed"):
    writer.write_scalars(8, {"loss": 0.0})


def test_jaxlines_tensorboard_logger_writes_to_the_modes_directory(tmp_path):
  from jaxline_ng import base_config, platform  # pylint: disable=import-outside-toplevel
  config = base_config.get_base_config()
  config.checkpoint_dir = str(tmp_path)
  logger = platform.TensorBoardLogger(config, "eval")  # jaxline's constructor
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with logger._writer.as_default():  # What jaxline's subclasses write through, from the start.
    tf.summary.scalar("extra", 1.5, step=2)
  logger.write_scalars(3, {"accuracy": 0.75})
  logger.write_scalars(4, {"accuracy": 0.5})
  # On disk when each write returns, as jaxline's: lab code may never close it.
  assert _read_scalars(tmp_path / "eval") == [
      (2, "extra", 1.5), (3, "accuracy", 0.75), (4, "accuracy", 0.5)]
  logger.close()


def test_tensorboard_writer_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
  temp_dir = tmp_path / "temp"
  temp_dir.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
  writer = writers.TensorBoardWriter(str(tmp_path / "logs"))
  writer.write_scalars(0, {"loss": 0.5})
  writer.close()
  assert not os.listdir(temp_dir)  # Autograph left a source file per writer.


def test_tensorboard_scalars_beyond_float32_nan_and_long_tags_read_back(tmp_path):
  # TensorBoard stores float32: a finite value beyond it becomes an infinity.
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer.write_scalars(1, {"a/" * 100: 1e39, "négatif": -1e39, "nan": math.nan, "count": 7})
  writer.close()
  scalars = _read_scalars(tmp_path)
  assert [(step, tag) for step, tag, _ in scalars] == [
      (1, "a/" * 100), (1, "négatif"), (1, "nan"), (1, "count")]
  big, negative, nan, count = (value for _, _, value in scalars)
  assert big == math.inf and negative == -math.inf and math.isnan(nan) and count == 7.0


def test_a_tensorboard_resume_hides_an_earlier_runs_points_past_the_step(tmp_path):
  from tensorboard.backend.event_processing import plugin_event_accumulator

  earlier = writers.TensorBoardWriter(str(tmp_path))
  for step in range(1, 6):
    earlier.write_scalars(step, {"loss": step / 2})
  earlier.close()
  time.sleep(1.1)  # Event file names start with their second: the next one sorts after.
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer.write_scalars(1, {"lr": 0.5})
  writer.flush()
  writer.resume(3)  # Steps 4 and 5 are redone: their earlier points must not show.
  writer.write_scalars(4, {"lr": 0.25, "loss": 4.0})
  writer.write_scalars(5, {"lr": 0.125, "loss": 5.0})
  writer.close()
  # What TensorBoard shows: it reads the files in name order and applies the purge.
  shown = plugin_event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  shown.Reload()
  points = {tag: [(event.step, float(tf_value(event))) for event in shown.Tensors(tag)]
            for tag in ("loss", "lr")}
  assert points == {"loss": [(1, 0.5), (2, 1.0), (3, 1.5), (4, 4.0), (5, 5.0)],
                    "lr": [(1, 0.5), (4, 0.25), (5, 0.125)]}


def tf_value(event):
  from tensorboard.util import tensor_util
  return tensor_util.make_ndarray(event.tensor_proto).item()


def test_tensorboard_images_histograms_and_texts_round_trip(tmp_path):
  import tensorflow as tf

  rng = np.random.default_rng(0)
  gray = rng.uniform(size=(4, 5))  # [H, W] floats in [0, 1].
  rgb = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)  # [H, W, C].
  batch = rng.integers(0, 256, size=(2, 3, 4, 1), dtype=np.uint8)  # [B,H,W,C].
  values = rng.normal(size=1000)
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer.write_images(3, {"gray": gray, "rgb": jnp.asarray(rgb), "batch": batch})
  writer.write_histograms(4, {"weights/w": values})
  writer.write_texts(5, {"notes": "hello *world*"})
  writer.close()

  events = {tag: (step, plugin, value) for step, tag, plugin, value in _read_events(tmp_path)}
  assert sorted(events) == ["batch", "gray", "notes", "rgb", "weights/w"]

  def decoded(tag):
    step, plugin, value = events[tag]
    assert (step, plugin) == (3, "images")
    # An image summary holds width, height, then one PNG per image.
    return [tf.io.decode_png(png).numpy() for png in value[2:]]

  [gray_png] = decoded("gray")
  np.testing.assert_allclose(gray_png[..., 0], gray * 255, atol=1)
  [rgb_png] = decoded("rgb")
  np.testing.assert_array_equal(rgb_png, rgb)
  np.testing.assert_array_equal(np.stack(decoded("batch")), batch)

  step, plugin, buckets = events["weights/w"]  # Rows of (left, right, count).
  assert (step, plugin) == (4, "histograms")
  assert buckets[:, 2].sum() == len(values)
  assert buckets[0, 0] == pytest.approx(values.min())
  assert buckets[-1, 1] == pytest.approx(values.max())

  step, plugin, text = events["notes"]
  assert (step, plugin, text.item()) == (5, "text", b"hello *world*")


def test_jsonl_writer(tmp_path):
  path = tmp_path / "new" / "dir" / "metrics.jsonl"
  writer = writers.JsonlWriter(str(path))
  writer.write_scalars(
      1,
      {
          "loss": jnp.asarray([0.5]),
          "score/eval": np.float64(2.25),
          "n": np.int32(3)
      },
  )
  writer.write_scalars(2, {"loss": float("nan"), "big": math.inf})
  writer.write_scalars(2, {})  # A step that returned nothing (log_all_train_data) has no row.
  writer.write_images(2, {"image": np.zeros((2, 2))})
  writer.write_histograms(2, {"h": np.zeros(3)})
  writer.write_texts(2, {"t": "ignored"})
  assert path.read_bytes() == b"", "lines reach the file at flush"
  writer.flush()

  lines = path.read_text().splitlines(keepends=True)
  assert lines[1] == '{"step": 2, "loss": NaN, "big": Infinity}\n'
  first, second = read_jsonl(path)
  assert first == {"step": 1, "loss": 0.5, "score/eval": 2.25, "n": 3}
  assert type(first["n"]) is int and type(first["loss"]) is float
  assert math.isnan(second["loss"]) and second["big"] == math.inf

  writer.write_scalars(3, {"step": 7, "loss": 1.0})  # A scalar named "step" (kfac-jax's).
  writer.flush()
  assert read_jsonl(path)[-1] == {"step": 3, "scalar/step": 7, "loss": 1.0}
  # Past the buffer size, lines are written out unprompted, but only whole.
  for step in range(10, 2010):
    writer.write_scalars(step, {"loss": step / 3})
  content = path.read_text()
  assert len(content.splitlines()) > 2 and content.endswith("\n")

  writer.close()
  writer.close()
  assert [row["step"] for row in read_jsonl(path)] == [1, 2, 3, *range(10, 2010)]
  with pytest.raises(ValueError, match="closed"):
    writer.write_scalars(3, {"loss": 0.0})


def test_multi_writer_calls_every_writer_even_after_a_failure():
  broken = _RecordingWriter(fail_at_step=1)
  healthy = _RecordingWriter()
  writer = writers.MultiWriter([broken, healthy])
  writer.write_scalars(0, {"a": 1.0})
  writer.write_images(0, {"b": 2.0})
  writer.write_histograms(0, {"c": 3.0})
  writer.write_texts(0, {"d": "e"})
  with pytest.raises(OSError, match="disk on fire"):
    writer.write_scalars(1, {"a": 4.0})
  writer.flush()
  writer.close()
  expected = [
      ("write_scalars", 0, {
          "a": 1.0
      }),
      ("write_images", 0, {
          "b": 2.0
      }),
      ("write_histograms", 0, {
          "c": 3.0
      }),
      ("write_texts", 0, {
          "d": "e"
      }),
  ]
  assert [c[:3] for c in broken.calls] == [*expected, ("flush", None, None)]
  assert [c[:3] for c in healthy.calls] == [
      *expected,
      ("write_scalars", 1, {
          "a": 4.0
      }),
      ("flush", None, None),
  ]
  assert broken.closed and healthy.closed


def test_adapt_gives_a_jaxline_writer_flush_close_and_resume(tmp_path):
  jaxline_writer = MinimalWriter()
  adapted = writers.adapt(jaxline_writer)
  assert isinstance(adapted, writers.RunWriter)
  adapted.write_scalars(1, {"loss": 0.5})
  adapted.resume(0, set_aside_past=0)  # A jaxline writer keeps what it wrote.
  adapted.flush()
  adapted.close()
  assert jaxline_writer.scalars == [(1, {"loss": 0.5})]
  # A writer with flush and close of its own gets them called; ours are returned as they are.
  recording = _RecordingWriter()
  writers.adapt(recording).flush()
  writers.adapt(recording).close()
  assert [call[0] for call in recording.calls] == ["flush"] and recording.closed
  ours = writers.make_writer(str(tmp_path), tensorboard=False)
  assert writers.adapt(ours) is ours and writers.adapt(None) is None
  ours.close()


def test_a_jaxline_writer_behind_the_async_writer_resumes_and_closes():
  jaxline_writer = MinimalWriter()
  writer = writers.AsyncWriter(jaxline_writer)
  writer.resume(5)
  writer.write_scalars(6, {"loss": 0.5})
  writer.close()
  assert jaxline_writer.scalars == [(6, {"loss": 0.5})]


def test_async_writer_keeps_order_of_many_writes_on_disk(tmp_path):
  writer = writers.make_writer(str(tmp_path))
  steps = range(2000)
  for step in steps:
    writer.write_scalars(step, {"x/y": step / 2})
  writer.flush()  # Everything must be on disk now, before close.

  assert _read_scalars(tmp_path) == [(step, "x/y", step / 2) for step in steps]
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert rows == [{"step": step, "x/y": step / 2} for step in steps]
  writer.close()


def test_without_tensorboard_only_metrics_jsonl_is_written(tmp_path):
  writer = writers.make_writer(str(tmp_path), tensorboard=False)
  writer.write_scalars(1, {"loss": 0.5})
  writer.close()
  assert os.listdir(tmp_path) == ["metrics.jsonl"]
  assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]


def test_async_writer_blocks_caller_when_queue_is_full():
  gate = threading.Event()
  inner = _RecordingWriter(gate=gate)
  max_queue_size = 3
  writer = writers.AsyncWriter(inner, max_queue_size=max_queue_size)
  accepted = []
  pending_seen = []

  def produce():
    for step in range(20):
      writer.write_scalars(step, {"x": step})
      accepted.append(step)
      pending_seen.append(len(accepted) - inner.completed)

  producer = threading.Thread(target=produce)
  producer.start()
  try:
    assert inner.entered.wait(5)  # The worker is stuck in the first write.
    deadline = time.monotonic() + 5
    while len(accepted) < max_queue_size and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.2)  # Ample time for an unbounded queue to take all 20.
    assert accepted == list(range(max_queue_size))
    assert producer.is_alive()
  finally:
    gate.set()  # Even on failure: a stuck worker would hang exit.
  producer.join(5)
  writer.close()
  assert max(pending_seen) <= max_queue_size
  assert [step for _, step, _, _ in inner.calls] == list(range(20))


def test_async_writer_copies_to_host_on_the_worker_thread():

  class DeviceValueProbe:
    """Array-like recording the threads that copy it to host."""

    def __init__(self):
      self.threads = []

    def copy_to_host_async(self):
      self.threads.append(threading.current_thread())

    def __array__(self, dtype=None, copy=None):
      self.threads.append(threading.current_thread())
      return np.asarray(2.0, dtype)

  probe = DeviceValueProbe()
  inner = _RecordingWriter()
  writer = writers.AsyncWriter(inner)
  on_device = jnp.arange(3.0).sum()
  writer.write_scalars(jnp.asarray(5), {"device": on_device, "probe": probe})
  writer.close()

  [(_, step, values, worker)] = inner.calls
  assert worker is not threading.current_thread()
  assert probe.threads == [worker, worker]
  assert type(step) is int and step == 5
  assert not isinstance(values["device"], jax.Array)
  assert isinstance(values["device"], np.ndarray) and values["device"] == 3.0
  assert values["probe"] == 2.0


def test_async_writer_passes_host_rows_on_without_device_get(monkeypatch):
  """Rows of host numbers (what logging every step writes) skip `jax.device_get`."""
  def no_device_get(tree):
    raise AssertionError(f"device_get of a host row: {tree}")

  monkeypatch.setattr(writers.jax, "device_get", no_device_get)
  inner = _RecordingWriter()
  writer = writers.AsyncWriter(inner)
  writer.write_scalars(3, {"loss": 0.5, "count": 7, "mean": np.float32(2.0),
                           "image": np.zeros((2, 2))})
  writer.close()
  [(_, step, values, _)] = inner.calls
  assert step == 3 and values["loss"] == 0.5 and values["count"] == 7


def test_async_writer_reraises_worker_error_on_next_call_and_close():
  inner = _RecordingWriter(fail_at_step=1)
  writer = writers.AsyncWriter(inner)
  writer.write_scalars(0, {"x": 0.0})
  writer.write_scalars(1, {"x": 1.0})
  assert inner.failed.wait(5)

  def next_write():
    # The worker records the failure just after the inner writer raised
    # it; writes accepted until then are dropped.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
      writer.write_scalars(2, {"x": 2.0})
      time.sleep(0.001)

  for call in (next_write, writer.flush, writer.close, writer.close):
    with pytest.raises(writers.WriterError) as raised:
      call()
    original = raised.value.__cause__
    assert isinstance(original, OSError) and str(original) == "disk on fire"
    # The worker-side traceback, down to the failing line, is kept.
    assert "_record" in "".join(traceback.format_exception(raised.value))
  assert [step for _, step, _, _ in inner.calls] == [0]
  assert inner.closed  # Closed despite the failure, releasing its files.


def test_async_writer_close_is_idempotent_and_final():
  inner = _RecordingWriter()
  writer = writers.AsyncWriter(inner)
  writer.write_texts(0, {"t": "x"})
  writer.close()
  writer.close()
  writer.flush()  # Nothing left to flush: a no-op.
  assert inner.closed and len(inner.calls) == 1
  with pytest.raises(ValueError, match="closed AsyncWriter"):
    writer.write_scalars(1, {"x": 1.0})


@pytest.mark.parametrize("use_async", [True, False])
def test_unwritable_logdir_raises_on_calling_thread(tmp_path, use_async):
  regular_file = tmp_path / "file"
  regular_file.write_text("")
  writer = writers.make_writer(str(regular_file / "run"), use_async=use_async)
  if use_async:
    # Fails on the worker (readying TensorBoard, or at the write), and is
    # raised on this thread by the next call at the latest.
    with pytest.raises(writers.WriterError) as raised:
      writer.write_scalars(0, {"x": 0.0})
      writer.flush()
    error = raised.value.__cause__
    with pytest.raises(writers.WriterError):
      writer.close()
  else:
    with pytest.raises(OSError) as raised:
      writer.write_scalars(0, {"x": 0.0})
    error = raised.value
    writer.close()
    # Both sinks failed; the second one's error rides along as a note.
    assert any("also failed" in note for note in error.__notes__)
  assert isinstance(error, NotADirectoryError)


def test_async_writer_close_from_signal_handler_mid_write():
  # A subprocess, so that a deadlock fails the test (timeout) instead of
  # hanging the whole suite.
  _run_python("""
    import signal, threading, time
    from jaxline_ng import writers

    class SlowWriter:
      def __init__(self):
        self.steps, self.closed = [], False
      def write_scalars(self, step, scalars):
        time.sleep(0.01)  # Mid-write whenever the signal arrives.
        self.steps.append(step)
      def flush(self):
        pass
      def close(self):
        self.closed = True

    inner = SlowWriter()
    writer = writers.AsyncWriter(inner, max_queue_size=2)
    signal.signal(signal.SIGUSR1, lambda *_: writer.close())
    threading.Timer(
      0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1)
    ).start()
    accepted = []
    try:
      for step in range(1000):  # 10 s of writes: the signal comes first.
        writer.write_scalars(step, {"x": step})
        accepted.append(step)
    except ValueError as e:
      assert "closed" in str(e)
    else:
      raise AssertionError("writes after close were accepted")
    assert inner.closed
    # A write that raced with close may be dropped, but nothing before it.
    assert inner.steps in (accepted, accepted[:-1]), (inner.steps, accepted)
    assert len(accepted) > 2, "closed before the worker wrote anything"
    """)


def test_queued_writes_reach_disk_at_interpreter_exit(tmp_path):
  # No flush, no close. The main thread ends well before TensorFlow (which
  # the first write imports) is loaded; a non-daemon thread writes on after.
  _run_python(
      """
    import sys, threading, time
    import jax.numpy as jnp
    from jaxline_ng import writers

    writer = writers.make_writer(sys.argv[1])

    def write(steps):
      for step in steps:
        writer.write_scalars(step, {"loss": jnp.asarray(step / 4)})

    def write_after_main_thread_ended():
      time.sleep(0.5)
      write(range(25, 50))

    write(range(25))
    threading.Thread(target=write_after_main_thread_ended).start()
    """,
      str(tmp_path),
  )
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert rows == [{"step": step, "loss": step / 4} for step in range(50)]
  scalars = _read_scalars(tmp_path)
  assert scalars == [(step, "loss", step / 4) for step in range(50)]


def test_writes_show_up_without_a_flush_while_the_run_goes_on(tmp_path):
  writer = writers.make_writer(str(tmp_path))
  try:
    for step in range(1, 4):
      writer.write_scalars(step, {"loss": float(step)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      jsonl = tmp_path / "metrics.jsonl"
      if jsonl.exists() and len(jsonl.read_text().splitlines()) == 3 and \
          len(_read_scalars(tmp_path)) == 3:
        break
      time.sleep(0.2)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert _read_scalars(tmp_path) == [(1, "loss", 1.0), (2, "loss", 2.0), (3, "loss", 3.0)]
  finally:
    writer.close()


def test_jsonl_resume_drops_rows_past_the_step_and_a_torn_line_keeping_the_rest(tmp_path):
  path = tmp_path / "metrics.jsonl"
  kept = b'{"step": 1, "loss": 0.5}\n{"step": 2, "loss": NaN}\n'
  path.write_bytes(kept + b'{"step": 3, "loss": 0.25}\n{"step": 4, "lo')
  writer = writers.JsonlWriter(str(path))
  writer.resume(2)
  assert path.read_bytes() == kept
  writer.write_scalars(3, {"loss": 0.125})
  writer.close()
  assert path.read_bytes() == kept + b'{"step": 3, "loss": 0.125}\n'


def test_jsonl_resume_reads_only_the_end_of_a_long_file(tmp_path, monkeypatch):
  # A run logging every step for days has a file of millions of rows; reading
  # it whole at every resume took seconds and hundreds of MB.
  path = tmp_path / "metrics.jsonl"
  rows = b"".join(b'{"step": %d, "loss": 0.5}\n' % step for step in range(1, 100_001))
  path.write_bytes(rows)
  read = []

  class Counted(io.FileIO):

    def read(self, size=-1):
      data = super().read(size)
      read.append(len(data))
      return data

  monkeypatch.setattr(metric_files, "open", Counted, raising=False)
  writers.JsonlWriter(str(path)).resume(99_990)
  assert path.read_bytes() == rows[:rows.index(b'{"step": 99991,')]
  assert sum(read) < len(rows) // 10, (sum(read), len(rows))


def test_a_start_from_step_0_sets_an_earlier_runs_rows_aside(tmp_path, caplog):
  # Its checkpoints were deleted, or never durable: nothing resumes those rows.
  path = tmp_path / "metrics.jsonl"
  earlier = b'{"step": 10, "loss": 0.5}\n{"step": 20, "loss": 0.25}\n'
  path.write_bytes(earlier)
  writer = writers.JsonlWriter(str(path))
  writer.resume(0)
  writer.write_scalars(1, {"loss": 2.0})
  writer.close()
  assert path.read_bytes() == b'{"step": 1, "loss": 2.0}\n'
  aside = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.")]
  assert len(aside) == 1 and aside[0].read_bytes() == earlier
  assert "held 2 rows of an earlier run" in caplog.text and str(aside[0]) in caplog.text


@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_metrics_file_moved_or_deleted_under_the_run_is_one_line_naming_it(tmp_path, how):
  # A renamed checkpoint_dir went unnoticed: the run wrote rows under the new
  # name and checkpoints under the old, and a second run took the old name.
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  path = run_dir / "metrics.jsonl"
  writer = writers.JsonlWriter(str(path))
  writer.write_scalars(1, {"loss": 0.5})
  writer.flush()
  if how == "deleted":
    path.unlink()
  else:
    run_dir.rename(tmp_path / "run_renamed")
  writer.write_scalars(2, {"loss": 0.5})
  with pytest.raises(writers.MetricsWriteError,
                     match=f"cannot write {path}: moved or deleted while the run was writing it"):
    writer.flush()


def test_set_asides_in_the_same_second_each_keep_their_rows(tmp_path):
  path = tmp_path / "metrics.jsonl"
  for step in (10, 20, 30):
    path.write_bytes(b'{"step": %d, "loss": 0.5}\n' % step)
    writers.JsonlWriter(str(path)).resume(0)
  aside = sorted(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl."))
  assert aside == [b'{"step": %d, "loss": 0.5}\n' % step for step in (10, 20, 30)]


def test_a_resume_it_cannot_read_or_cut_is_one_line_naming_the_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.mkdir()
  with pytest.raises(writers.MetricsWriteError, match=f"cannot write {path}: Is a directory"):
    writers.JsonlWriter(str(path)).resume(5)


def test_async_resume_runs_before_the_writes_after_it(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n')
  writer = writers.AsyncWriter(writers.JsonlWriter(str(path)))
  writer.resume(1)
  writer.write_scalars(2, {"x": 3})
  writer.close()
  assert path.read_bytes() == b'{"step": 1, "x": 1}\n{"step": 2, "x": 3}\n'


def test_a_full_disk_under_metrics_is_one_line_naming_the_file():
  # /dev/full refuses every write with ENOSPC, as a full disk does.
  for writer in (writers.JsonlWriter("/dev/full"),
                 writers.AsyncWriter(writers.JsonlWriter("/dev/full"))):
    writer.write_scalars(1, {"loss": 0.5})
    with pytest.raises((writers.MetricsWriteError, writers.WriterError)) as raised:
      writer.flush()
    # The platform prints it as one line, exit 1.
    assert isinstance(raised.value, errors.OneLineError)
    assert str(raised.value).endswith(
        "[Errno 28] cannot write /dev/full: No space left on device")
    with pytest.raises((writers.MetricsWriteError, writers.WriterError)):
      writer.close()


@pytest.mark.parametrize("step, scalars, culprit", [
    (1, {"loss": 0.5, "lr": np.ones(3)}, "write_scalars: scalar 'lr' is ndarray array([1., "
                                          "1., 1.]) of shape (3,): write a number"),
    (1, {"mode": "fast"}, "write_scalars: scalar 'mode' is str 'fast': write a number"),
    (np.arange(4), {"loss": 0.5}, "writer: global_step array([0, 1, 2, 3]) is not one step"),
])
def test_values_a_writer_cannot_write_are_one_line_naming_them(tmp_path, step, scalars, culprit):
  # A step that writes through the writer it is given, not what it returns (which
  # the loop checks): the failure came back as three tracebacks naming nothing.
  writer = writers.make_writer(str(tmp_path))
  writer.write_scalars(step, scalars)
  with pytest.raises(writers.WriterError, match=re.escape(culprit)) as raised:
    writer.close()
  assert isinstance(raised.value, errors.OneLineError)


@pytest.mark.parametrize("tensorboard", [False, True], ids=["jsonl", "tensorboard"])
def test_an_image_a_writer_cannot_write_is_one_line_naming_it(tmp_path, tensorboard):
  # TensorBoard's failure named no image; without TensorBoard it went unnoticed.
  writer = writers.make_writer(str(tmp_path), tensorboard=tensorboard)
  writer.write_images(1, {"grid": np.zeros((8, 8)), "samples": "not an image"})
  with pytest.raises(writers.WriterError, match=re.escape(
      "write_images: image 'samples' is str 'not an image' of shape (): write [H, W], [H, W, C] "
      "or [B, H, W, C]")) as raised:
    writer.close()
  assert isinstance(raised.value, errors.OneLineError)
