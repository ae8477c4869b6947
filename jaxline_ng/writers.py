"""Metric writers: TensorBoard, JSON lines, fan-out, and a background writer.

A run logs through `make_writer`, which returns an `AsyncWriter` around
TensorBoard and JSONL sinks. The training loop only enqueues: converting
device arrays to host memory, importing TensorFlow and touching the disk all
happen on one background thread, while a bounded queue keeps a slow disk
from growing memory without limit. Failures of that thread surface on the
training thread at its next call, and queued data is written out at normal
interpreter exit.
"""

import atexit
import contextlib
import errno
import functools
import io
import json
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from absl import logging

from jaxline_ng import background

# Enough to absorb a slow flush without stalling training, while the device
# buffers referenced by queued writes stay negligible.
_DEFAULT_MAX_QUEUE_SIZE = 128

# JsonlWriter writes buffered lines out once they exceed this many bytes.
_JSONL_BUFFER_BYTES = 1 << 16

# TensorBoardWriter writes buffered scalar rows at least this often, and once
# this many wait.
_COMMIT_SECONDS = 0.5
_MAX_BUFFERED_ROWS = 1000

# AsyncWriter flushes its writer after this long without work, so what was
# written shows in TensorBoard and metrics.jsonl while the run goes on.
_IDLE_FLUSH_SECONDS = 0.5


class Writer(Protocol):
  """Sink for metrics, keyed by training step.

  Values may be Python numbers, NumPy arrays or scalars, or `jax.Array`s
  (possibly still being computed). Names may contain `/`, e.g. `score/eval`.
  """

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    """Writes scalars: 0-d values or arrays of shape [1]."""

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    """Writes images of shape [H, W], [H, W, C] or [B, H, W, C].

    Pixels are floats in [0, 1] or uint8; C is 1, 3 or 4.
    """

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    """Writes a histogram of each array's elements."""

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    """Writes text (TensorBoard renders it as Markdown)."""

  def flush(self) -> None:
    """Returns once everything written so far is on disk."""

  def close(self) -> None:
    """Flushes and releases resources; calling it again has no effect."""


class WriterError(RuntimeError):
  """A background write failed; `__cause__` is the original exception."""


class MetricsWriteError(OSError):
  """The filesystem refused a metrics file (full, read-only, gone); names the file."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


def _background_failure(error: BaseException) -> WriterError:
  """What the caller's thread raises for `error` of a background write: one
  line (naming the file) when `error` says all there is to say."""
  if getattr(error, "one_line", False):
    failure = WriterError(f"metric writing failed: {error}")
    failure.one_line = True
    return failure
  return WriterError(f"Background metric writing failed: {error!r}")


class WriteInputError(ValueError):
  """A value handed to a writer cannot be written; the message names it."""
  one_line = True  # Reported as one line naming the culprit, not a traceback.


def _to_number(value: Any, name: str) -> int | float:
  """Scalar metric `name` as a Python number: integers stay int, all else float."""
  if type(value) in (int, float):  # What the training loop's logging passes: no NumPy round trip.
    return value
  try:
    array = np.asarray(value).reshape(())
    return int(array) if np.issubdtype(array.dtype, np.integer) else float(array)
  except (TypeError, ValueError):
    shape = f" of shape {np.shape(value)}" if hasattr(value, "shape") else ""
    raise WriteInputError(f"write_scalars: scalar {name!r} is {type(value).__name__} "
                          f"{value!r:.40}{shape}: write a number or an array of one") from None


def _to_step(global_step: Any) -> int:
  """The step a row is written at, as an int."""
  if type(global_step) is int:  # What the training loop's logging passes.
    return global_step
  try:
    return int(np.asarray(global_step).reshape(()))
  except (TypeError, ValueError):
    raise WriteInputError(f"writer: global_step {global_step!r:.40} is not one step: "
                          "pass an int (in pmap mode, the step as a number, not the per-device "
                          "array)") from None


def _check_image(value: Any, name: str) -> None:
  """Raises WriteInputError unless `value` is an image or image batch (its shape alone
  is looked at: a device array is not copied)."""
  if np.ndim(value) not in (2, 3, 4):
    raise WriteInputError(f"write_images: image {name!r} is {type(value).__name__} "
                          f"{value!r:.40} of shape {np.shape(value)}: write [H, W], [H, W, C] or "
                          "[B, H, W, C]")


def _to_image_batch(value: Any, name: str) -> np.ndarray:
  """Image `name`, an image or image batch, as the [B, H, W, C] array TensorBoard expects."""
  _check_image(value, name)
  image = np.asarray(value)
  match image.ndim:
    case 2:
      return image[None, :, :, None]
    case 3:
      return image[None]
  return image


class TensorBoardWriter:
  """Writes TensorBoard event files with `tf.summary`, synchronously.

  TensorFlow is imported and the event file created at the first write, so
  constructing this writer is free. Scalars are the hot path (a run may log
  every step): rows are buffered and written in batches by one compiled
  `tf.function`, a small fraction of the cost of a `tf.summary.scalar` call
  per value. A batch is written once
  `_COMMIT_SECONDS` have passed since the last one or `_MAX_BUFFERED_ROWS`
  rows wait, before any image/histogram/text (so events stay in step order),
  and on `flush()`/`close()`. Events reach the disk on `flush()`/`close()`
  (TensorFlow may write them through earlier).
  """

  def __init__(self, logdir: str):
    # The first write may come at interpreter exit (see AsyncWriter). The
    # TensorFlow import then loads these modules, whose import registers a
    # threading exit hook, which Python refuses once shutdown has begun.
    import concurrent.futures.process  # noqa: F401
    import concurrent.futures.thread  # noqa: F401

    self._logdir = logdir
    self._tf: Any = None
    self._writer: Any = None
    self._write_rows: Any = None
    self._rows: list[tuple[int, bytes]] = []
    self._last_commit = time.monotonic()
    self._closed = False
    # Whether the log held event files (an earlier run's) when this writer opened its own.
    self._earlier_events: bool | None = None

  def _open(self) -> None:
    if self._closed:
      raise ValueError(f"TensorBoardWriter({self._logdir!r}) is closed.")
    if self._writer is not None:
      return
    import tensorflow as tf

    try:
      # TensorFlow must not claim GPU memory that JAX needs, nor CPU time:
      # its thread pools (sized to the machine, spinning while they wait)
      # would compete with the training computation for the same cores.
      tf.config.set_visible_devices([], "GPU")
      tf.config.threading.set_intra_op_parallelism_threads(1)
      tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
      pass  # The TF runtime is already initialised; its settings are fixed.
    # TF reports a bad logdir as an op failure; this gives a plain OSError.
    os.makedirs(self._logdir, exist_ok=True)
    if self._earlier_events is None:
      self._earlier_events = bool(_event_files(self._logdir))
    writer = tf.summary.create_file_writer(self._logdir)

    # An explicit while_loop, not autograph: autograph converts the function
    # through a generated source file that it leaves in the temp directory,
    # one per writer (per run).
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None], tf.string)], autograph=False)
    def write_rows(steps, summaries):

      def write_row(i):
        written = tf.summary.experimental.write_raw_pb(summaries[i], step=steps[i])
        with tf.control_dependencies([written]):
          return i + 1

      with writer.as_default():
        tf.while_loop(lambda i: i < tf.shape(steps)[0], write_row, [tf.constant(0)])
      return tf.constant(0)

    self._tf, self._writer, self._write_rows = tf, writer, write_rows

  def prepare(self) -> None:
    """Imports TensorFlow, opens the log and compiles the row writer, ahead of the first write."""
    self._open()
    self._write_rows(self._tf.zeros([0], self._tf.int64), self._tf.zeros([0], self._tf.string))

  def _at_step(self, global_step: int) -> Any:
    """A context in which `tf.summary` ops write to this log at `global_step`."""
    self._open()
    self._commit()
    return self._writer.as_default(step=int(global_step))

  def _commit(self) -> None:
    """Writes the buffered scalar rows."""
    self._last_commit = time.monotonic()
    if not self._rows:
      return
    rows, self._rows = self._rows, []
    steps, summaries = zip(*rows)
    self._write_rows(self._tf.constant(steps, self._tf.int64),
                     self._tf.constant(summaries, self._tf.string))

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self._open()
    self._rows.append((_to_step(global_step), b"".join(
        _summary_value_bytes(name, _to_number(value, name)) for name, value in scalars.items())))
    if (len(self._rows) >= _MAX_BUFFERED_ROWS or
        time.monotonic() - self._last_commit >= _COMMIT_SECONDS):
      self._commit()

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    with self._at_step(global_step):
      for name, value in images.items():
        batch = _to_image_batch(value, name)
        self._tf.summary.image(name, batch, max_outputs=batch.shape[0])

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    with self._at_step(global_step):
      for name, value in values.items():
        self._tf.summary.histogram(name, np.asarray(value))

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    with self._at_step(global_step):
      for name, text in texts.items():
        self._tf.summary.text(name, text)

  def flush(self) -> None:
    if self._writer is not None:
      self._commit()
      self._writer.flush()

  def resume(self, global_step: int, *, set_aside_past: int | None = None) -> None:
    """Marks a restart after `global_step`: TensorBoard drops earlier runs' points past it.

    TensorBoard's own mechanism: a `SessionLog` START event at step s hides
    every point at step >= s read before it, except that the first START of
    a log only marks its beginning. Two are written, so the second hides
    the points whether or not the earlier runs wrote a first one (a second
    purge at the same step changes nothing). They go in a file of their own,
    named to sort after the earlier runs' files, and this writer then
    starts a new file that sorts after it (TensorBoard reads a log's files
    in name order), so this run's points stay. Without earlier event files
    there is nothing to hide and nothing is written. `set_aside_past` is
    `JsonlWriter.resume`'s: the event files stay whole, the points are hidden.
    """
    del set_aside_past
    self._open()
    if not self._earlier_events:
      return
    from tensorboard.compat.proto import event_pb2  # Loaded with TensorFlow, by now.

    self._commit()
    self._writer.close()
    self._writer = None
    now = time.time()
    path = os.path.join(self._logdir, f"events.out.tfevents.{int(now):010d}."
                        f"{socket.gethostname()}.{os.getpid()}.resume")
    with self._tf.io.TFRecordWriter(path) as records:
      records.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2")
                    .SerializeToString())
      start = event_pb2.Event(
          wall_time=now, step=int(global_step) + 1,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
      records.write(start.SerializeToString())
      records.write(start.SerializeToString())
    # Event file names start with the second they were made in: the next
    # one must be made in a later second to sort after this one.
    time.sleep(max(0.0, math.floor(now) + 1 - time.time()) + 0.01)
    self._open()

  def close(self) -> None:
    if self._writer is not None:
      self._commit()
      self._writer.close()
      self._writer = None
    self._closed = True


def _event_files(logdir: str) -> list[str]:
  return [name for name in os.listdir(logdir) if ".tfevents." in name]


def _varint(value: int) -> bytes:
  """`value` as a protobuf varint: 7 bits a byte, low bits first."""
  encoded = bytearray()
  while True:
    byte, value = value & 0x7F, value >> 7
    encoded.append(byte | (0x80 if value else 0))
    if not value:
      return bytes(encoded)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited protobuf field (wire type 2): key, length, payload."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


# The `TensorProto` of a float32 scalar up to its 4 value bytes: dtype (1) =
# DT_FLOAT (1), then the key and length of float_val (5, packed).
_FLOAT32_TENSOR_HEAD = b"\x08\x01" + _varint(5 << 3 | 2) + _varint(4)


@functools.lru_cache(maxsize=4096)
def _summary_value_head(tag: str) -> bytes:
  """A `Summary.value` entry (field 1 of `Summary`) for `tag` up to its value bytes:
  its key and length, `tag` (1), `metadata` (9, the scalars plugin) and the
  key, length and head of `tensor` (8). Every entry of a tag has this head."""
  from tensorboard.compat.proto import summary_pb2  # Loaded with TensorFlow, by now.

  metadata = summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
  head = _field(1, tag.encode()) + _field(9, metadata.SerializeToString())
  tensor = _field(8, _FLOAT32_TENSOR_HEAD + bytes(4))
  entry = _field(1, head + tensor)
  return entry[:-4]


def _summary_value_bytes(tag: str, value: float) -> bytes:
  """One `Summary.value` entry as `tf.summary.scalar` writes it: a float32
  tensor tagged for the scalars plugin.

  Serialized by hand, from a cached head, rather than building protos for
  every value of every step a run may log.
  """
  try:
    value_bytes = struct.pack("<f", value)
  except OverflowError:  # Finite, but beyond float32: what a cast to float32 gives.
    value_bytes = struct.pack("<f", math.copysign(math.inf, value))
  return _summary_value_head(tag) + value_bytes


class JsonlWriter:
  """Appends one JSON object per `write_scalars` call to a file, synchronously.

  Each line is `{"step": <int>, "<name>": <number>, ...}`, a scalar itself
  named "step" written as "scalar/step". Integer values stay
  integers, all others become floats; NaN and infinities are written as
  `NaN`, `Infinity` and `-Infinity`, as Python's `json` does: Python and
  pandas read them back, strict RFC 8259 parsers reject them. Lines are kept
  in memory and reach the file only whole, on `flush()`, `close()` or when
  `_JSONL_BUFFER_BYTES` have accumulated. The file and its parent directories
  are created at the first write. Images, histograms and texts are ignored.
  """

  def __init__(self, path: str):
    self._path = path
    self._file: Any = None
    self._lines: list[bytes] = []
    self._buffered_bytes = 0
    self._closed = False

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    if self._closed:
      raise ValueError(f"JsonlWriter({self._path!r}) is closed.")
    if not scalars:
      return  # A row of its step alone says nothing; TensorBoard gets no point either.
    if "step" in scalars:
      # The row's "step" is the global step; a scalar of that name (kfac-jax
      # returns its optimizer's step counter, which jaxline wrote as is) goes beside it.
      scalars = {("scalar/step" if name == "step" else name): value
                 for name, value in scalars.items()}
    if self._file is None:
      # Opened here, not at flush, so a bad path fails the first write.
      with self._naming_the_file():
        os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
        self._file = open(self._path, "ab")
    row = {"step": _to_step(global_step)}
    row.update((name, _to_number(value, name)) for name, value in scalars.items())
    line = (json.dumps(row) + "\n").encode()
    self._lines.append(line)
    self._buffered_bytes += len(line)
    if self._buffered_bytes >= _JSONL_BUFFER_BYTES:
      self.flush()

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    # Not written here, but refused as TensorBoard would: a run logging to
    # both must not fail only when TensorBoard is on.
    del global_step
    for name, value in images.items():
      _check_image(value, name)

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    del global_step, values

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    del global_step, texts

  def flush(self) -> None:
    if not self._lines:
      return
    data = b"".join(self._lines)
    # Dropped before writing: if the write fails part-way, retrying the same
    # lines would leave a torn line followed by duplicates.
    self._lines.clear()
    self._buffered_bytes = 0
    with self._naming_the_file():
      if not self._still_at_its_path():
        # Deleted or moved under the run (its checkpoint_dir removed or
        # renamed): rows written on would reach no file, or another one than
        # the run's, whose checkpoints would go on under the old name.
        raise OSError(errno.ENOENT, "moved or deleted while the run was writing it")
      self._file.write(data)
      self._file.flush()

  def _still_at_its_path(self) -> bool:
    """Whether the file open for appending is still the one at its path (a
    deleted one is not: its inode, held open, cannot be another file's)."""
    opened = os.fstat(self._file.fileno())
    try:
      at_path = os.stat(self._path)
    except FileNotFoundError:
      return False
    return (opened.st_dev, opened.st_ino) == (at_path.st_dev, at_path.st_ino)

  @contextlib.contextmanager
  def _naming_the_file(self):
    try:
      yield
    except OSError as e:
      raise MetricsWriteError(e.errno, f"cannot write {self._path}: {e.strerror or e}") from None

  def resume(self, global_step: int, *, set_aside_past: int | None = None) -> None:
    """Drops rows past `global_step`: an interrupted run's, about to be redone.

    The rows kept stay byte for byte: the file is cut after the last of them,
    found by reading back from its end (a long run's file is never read
    whole), so a crash here leaves either the old file or the cut one. A torn
    last line (the interrupted run died mid-write) goes too.

    Rows past `set_aside_past` are an earlier run's instead, which nothing
    will redo (its checkpoints deleted, or never durable): the whole file is
    moved aside, kept, and named in a warning. By default that is any row of
    a step after 0 when `global_step` is 0: a run starting afresh.
    """
    self.flush()
    if not os.path.exists(self._path):
      return
    if set_aside_past is None and global_step <= 0:
      set_aside_past = 0
    with self._naming_the_file():
      with open(self._path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        cut, newest = _end_of_rows_up_to(f, global_step)
      if cut == size:
        return
      if self._file is not None:
        self._file.close()
        self._file = None
      if set_aside_past is not None and newest is not None and newest > set_aside_past:
        self._set_aside(global_step)
        return
      with open(self._path, "r+b") as f:
        f.truncate(cut)
        os.fsync(f.fileno())

  def _set_aside(self, global_step: int) -> None:
    aside = stamped = f"{self._path}.{time.strftime('%Y%m%dT%H%M%S')}"
    copies = 0
    while os.path.exists(aside):  # Never onto an earlier set-aside of the same second.
      copies += 1
      aside = f"{stamped}.{copies}"
    os.replace(self._path, aside)
    with open(aside, "rb") as f:
      rows = sum(1 for _ in f)
    logging.warning("[jaxline_ng] %s held %d rows of an earlier run, which go past step %d "
                    "where this one goes on: they are now in %s.",
                    self._path, rows, global_step, aside)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._file is not None:
      try:
        self.flush()
      finally:
        with self._naming_the_file():
          self._file.close()  # Writes what a failed flush left in the file's buffer.


# How much of the end of `metrics.jsonl` a resume reads at a time.
_RESUME_READ_BYTES = 1 << 16


def _end_of_rows_up_to(f, global_step: int) -> tuple[int, int | None]:
  """`(offset, newest)`: the offset in `f` just past the last row of a step
  <= `global_step` (0 if none; rows are appended in step order), reading back
  from the end, and the step of the file's last row (None if none)."""
  end = f.seek(0, os.SEEK_END)
  start = end
  newest = None
  while start > 0:
    start = max(0, start - _RESUME_READ_BYTES)
    f.seek(start)
    tail = f.read(end - start)
    lines = io.BytesIO(tail).readlines()  # Split at b"\n" alone, as rows end.
    # The first line may begin before `start`: keep it for the next read.
    for line in reversed(lines[1:] if start > 0 else lines):
      step = _row_step(line)
      if step is not None:
        newest = step if newest is None else newest
        if step <= global_step:
          return end, newest
      end -= len(line)
  return 0, newest


def _row_step(line: bytes) -> int | None:
  """The step of a complete JSONL row; None for a torn or foreign line."""
  if not line.endswith(b"\n"):
    return None
  try:
    step = json.loads(line).get("step")
  except (ValueError, AttributeError):
    return None
  return step if isinstance(step, int) else None


class MultiWriter:
  """Forwards every call to each of several writers, in order.

  Every writer is called even if an earlier one raises, so one broken sink
  neither starves the others nor keeps them open; the first exception is
  then re-raised, with the others attached as notes.
  """

  def __init__(self, writers: Sequence[Writer]):
    self._writers = tuple(writers)

  def _call_all(self, method: str, *args: Any, skip_missing: bool = False, **kwargs: Any) -> None:
    errors = []
    for writer in self._writers:
      if skip_missing and not hasattr(writer, method):
        continue
      try:
        getattr(writer, method)(*args, **kwargs)
      except Exception as e:
        errors.append(e)
    if errors:
      for other in errors[1:]:
        errors[0].add_note(f"Another writer also failed: {other!r}")
      raise errors[0]

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self._call_all("write_scalars", global_step, scalars)

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self._call_all("write_images", global_step, images)

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self._call_all("write_histograms", global_step, values)

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self._call_all("write_texts", global_step, texts)

  def prepare(self) -> None:
    """Readies the writers that can be readied ahead of their first write."""
    for writer in self._writers:
      if hasattr(writer, "prepare"):
        writer.prepare()

  def flush(self) -> None:
    self._call_all("flush")

  def resume(self, global_step: int, **kwargs: Any) -> None:
    """Resumes the writers that know how (see `JsonlWriter.resume`)."""
    self._call_all("resume", global_step, skip_missing=True, **kwargs)

  def close(self) -> None:
    self._call_all("close")


# Values of these types are on the host already: the writer thread passes
# them on without `jax.device_get`, which walks the row (logging every step
# writes a row a step).
_HOST_TYPES = (int, float, str, np.ndarray, np.generic)


class AsyncWriter:
  """Runs a synchronous writer on a `background.Worker`'s thread.

  The calling thread only enqueues (a shallow copy of the mapping: NumPy
  arrays passed in must not be mutated afterwards). The worker's thread
  moves device values to host memory with `jax.device_get` and calls the
  wrapped writer, so writes land in call order. Once `max_queue_size` calls are
  pending, writing blocks until the worker catches up.

  If the wrapped writer raises, this writer is failed for good: later writes
  are dropped, and every later `write_*`, `flush` and `close` raises a
  `WriterError` whose `__cause__` is the original exception.

  Queued writes reach disk at normal interpreter exit: `close` is registered
  with `atexit`, so it runs once all non-daemon threads are done writing.
  Before that, as the main thread ends, the worker writes out everything
  queued so far, because the first write may import TensorFlow, and
  libraries it loads (h5py) crash the interpreter if imported during `atexit`.

  `close` may run in a signal handler that interrupted the training thread
  mid-write (see `background`). A write racing with `close` may be dropped.
  """

  def __init__(self, writer: Writer, *, max_queue_size: int = _DEFAULT_MAX_QUEUE_SIZE):
    self._writer = writer
    self._closed = False
    self._worker = background.Worker(
        "jaxline_ng-writer", max_pending=max_queue_size,
        on_idle=(_IDLE_FLUSH_SECONDS, writer.flush),
        raise_as=_background_failure)
    # Readies the wrapped writer (TensorBoard imports TensorFlow, seconds of
    # work) now, while the run starts up, not at its first write.
    if hasattr(writer, "prepare"):
      self._worker.submit(writer.prepare)
    atexit.register(self.close)

  def _submit(self, fn: Callable[..., None], *args: Any) -> None:
    if self._closed:
      raise ValueError("Cannot write to a closed AsyncWriter.")
    self._worker.submit(fn, *args)

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_scalars, global_step, dict(scalars))

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_images, global_step, dict(images))

  def write_histograms(self, global_step: int, values: Mapping[str, Any]) -> None:
    self._submit(_write, self._writer.write_histograms, global_step, dict(values))

  def write_texts(self, global_step: int, texts: Mapping[str, str]) -> None:
    self._submit(_write, self._writer.write_texts, global_step, dict(texts))

  def resume(self, global_step: int, **kwargs: Any) -> None:
    """Has the wrapped writer drop what an interrupted run wrote past
    `global_step` (see `JsonlWriter.resume`, `TensorBoardWriter.resume`).

    Queued, not waited for: it runs before every later write, and the
    run's start does not wait for TensorFlow's import, which precedes it.
    """
    if hasattr(self._writer, "resume"):
      self._submit(functools.partial(self._writer.resume, **kwargs), global_step)

  def flush(self) -> None:
    """Blocks until every earlier write is on disk.

    Once closed, everything is on disk already, so this only re-raises a
    failure.
    """
    if not self._closed:
      self._worker.submit(self._writer.flush)
    self._worker.wait()

  def close(self) -> None:
    """Writes out everything queued, stops the worker, then closes the wrapped writer.

    The wrapped writer is closed on this thread (the worker's has ended),
    even after a failure, to release its files.
    """
    if self._closed:
      self._worker.close()  # Only re-raises a failure.
      return
    self._closed = True
    atexit.unregister(self.close)
    try:
      self._worker.close()
    finally:
      self._writer.close()


def _write(write: Callable[[int, Any], None], global_step: Any, values: dict[str, Any]) -> None:
  """On the worker's thread: copies device values to the host, then calls `write`."""
  if not all(isinstance(value, _HOST_TYPES) for value in values.values()):
    global_step, values = jax.device_get((global_step, values))
  write(_to_step(global_step), values)


def make_writer(logdir: str, *, use_async: bool = True, tensorboard: bool = True) -> Writer:
  """The writer a run logs through: TensorBoard plus `metrics.jsonl`.

  Both go to `logdir`. With `use_async`, they run behind an `AsyncWriter`.
  Construction does no I/O and does not import TensorFlow; a bad `logdir`
  is reported by the first write (or, asynchronously, the call after it).

  Args:
    logdir: the directory both write to.
    use_async: write on a background thread.
    tensorboard: write TensorBoard event files; False writes `metrics.jsonl`
      alone and never imports TensorFlow.

  Returns:
    The writer.
  """
  writer = MultiWriter([
      *([TensorBoardWriter(logdir)] if tensorboard else []),
      JsonlWriter(os.path.join(logdir, "metrics.jsonl")),
  ])
  return AsyncWriter(writer) if use_async else writer


def flush_if_possible(writer) -> None:
  """Flushes `writer` if it can: jaxline's `Writer` protocol requires only
  `write_scalars` and `write_images`."""
  flush = getattr(writer, "flush", None)
  if flush is not None:
    flush()
