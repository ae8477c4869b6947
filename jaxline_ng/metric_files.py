"""The files a run's metrics go to: TensorBoard event files and `metrics.jsonl`.

Both writers are synchronous and check their input alike, so a run never
fails only because TensorBoard is on. Each can `resume` after an interrupted run.
"""

import contextlib
import errno
import io
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from jaxline_ng import errors

# JsonlWriter writes buffered lines out once they exceed this many bytes.
_JSONL_BUFFER_BYTES = 1 << 16

# How much of the end of `metrics.jsonl` a resume reads at a time.
_RESUME_READ_BYTES = 1 << 16

# Events TensorFlow's file writer holds before writing them out (or a `flush`).
_TENSORBOARD_MAX_QUEUE = 1000

# TensorBoardWriter writes its buffered scalar rows once this many wait.
_MAX_BUFFERED_ROWS = 1000


class MetricsWriteError(OSError, errors.OneLineError):
  """The filesystem refused a metrics file (full, read-only, gone); names the file."""


class WriteInputError(ValueError, errors.OneLineError):
  """A value handed to a writer cannot be written; the message names it."""


def to_number(value: Any, name: str) -> int | float:
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


def to_step(global_step: Any) -> int:
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
  """Raises WriteInputError unless `value` is an image or image batch (by its shape alone)."""
  if np.ndim(value) not in (2, 3, 4):
    raise WriteInputError(f"write_images: image {name!r} is {type(value).__name__} "
                          f"{value!r:.40} of shape {np.shape(value)}: write [H, W], [H, W, C] or "
                          "[B, H, W, C]")


def _to_image_batch(value: Any, name: str) -> np.ndarray:
  """Image `name`, an image or image batch, as the [B, H, W, C] array TensorBoard expects."""
  _check_image(value, name)
  image = np.asarray(value)
  image = image[..., None] if image.ndim == 2 else image
  return image[None] if image.ndim == 3 else image


class TensorBoardWriter:
  """Writes TensorBoard event files with `tf.summary`.

  TensorFlow is imported and the log opened at the first write (or `prepare`).
  One eager `tf.summary` op per value costs more CPU than a small model's step,
  so scalar rows of the same names are buffered and written by one compiled
  program per set of names, before any other event (events stay in step order)
  and on `flush()`, `close()` and `resume()`.
  """

  def __init__(self, logdir: str):
    # The first write may come at interpreter exit (see writers.AsyncWriter), when Python
    # refuses the threading exit hook these modules register if TensorFlow imports them.
    import concurrent.futures.process  # noqa: F401
    import concurrent.futures.thread  # noqa: F401

    self._logdir = logdir
    self._tf: Any = None
    self._writer: Any = None
    self._closed = False
    self._tags: tuple[str, ...] = ()
    self._rows: list[tuple[int, list]] = []
    self._programs: dict[tuple[str, ...], Any] = {}
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
      # its thread pools would compete with the training computation.
      tf.config.set_visible_devices([], "GPU")
      tf.config.threading.set_intra_op_parallelism_threads(1)
      tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
      pass  # The TF runtime is already initialised; its settings are fixed.
    # TF reports a bad logdir as an op failure; this gives a plain OSError.
    os.makedirs(self._logdir, exist_ok=True)
    if self._earlier_events is None:
      self._earlier_events = any(".tfevents." in name for name in os.listdir(self._logdir))
    self._tf = tf
    self._writer = tf.summary.create_file_writer(self._logdir, max_queue=_TENSORBOARD_MAX_QUEUE)
    self._programs = {}  # Each holds the file writer it was compiled with.

  def prepare(self) -> None:
    """Imports TensorFlow and opens the log, ahead of the first write."""
    self._open()

  def _at_step(self, global_step: Any) -> Any:
    """A context in which `tf.summary` ops write to this log at `global_step`."""
    self._open()
    self._commit()
    return self._writer.as_default(step=to_step(global_step))

  def write_scalars(self, global_step: int, scalars: Mapping[str, Any]) -> None:
    row = [to_number(value, name) for name, value in scalars.items()]
    self._open()
    if not row:
      return
    tags = tuple(scalars)
    if tags != self._tags:
      self._commit()
      self._tags = tags
    self._rows.append((to_step(global_step), row))
    if len(self._rows) >= _MAX_BUFFERED_ROWS:
      self._commit()

  def _commit(self) -> None:
    """Writes the buffered scalar rows in one call of their compiled program."""
    if not self._rows:
      return
    steps, rows = zip(*self._rows)
    self._rows = []
    program = self._programs.get(self._tags)
    if program is None:
      program = self._programs[self._tags] = self._scalar_rows_program(self._tags)
    program(np.asarray(steps, np.int64), np.asarray(rows, np.float64).reshape(len(steps), -1))

  def _scalar_rows_program(self, tags: tuple[str, ...]) -> Any:
    """A program writing rows of scalars named `tags`: steps [N], values [N, len(tags)]."""
    from tensorboard.plugins.scalar import metadata as scalars  # Loaded with TensorFlow, by now.

    tf = self._tf
    metadata = scalars.create_summary_metadata(display_name=None, description=None)

    # `tf.summary.write`, as `tf.summary.scalar` does: inside the loop `scalar` would prefix
    # the loop's name scope to the tag. No autograph: it leaves source files in the temp dir.
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None, len(tags)], tf.float64)], autograph=False)
    def write_rows(steps, values):
      def write_row(i):
        written = [tf.summary.write(tag, tf.cast(values[i, j], tf.float32), step=steps[i],
                                    metadata=metadata) for j, tag in enumerate(tags)]
        with tf.control_dependencies(written):
          return i + 1

      with self._writer.as_default():
        tf.while_loop(lambda i: i < tf.shape(steps)[0], write_row, [tf.constant(0)])

    return write_rows

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

    TensorBoard's own mechanism: a `SessionLog` START at step s hides points at
    step >= s read before it (a log's first START only marks its beginning, so two
    are written), in a file sorting after the earlier ones and before this run's
    next file. `set_aside_past` is `JsonlWriter.resume`'s; event files stay whole.
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


class JsonlWriter:
  """Appends one JSON object per `write_scalars` call to a file, synchronously.

  Each line is `{"step": <int>, "<name>": <number>, ...}` (a scalar named "step"
  as "scalar/step"; NaN and infinities as Python's `json` writes them). Lines
  reach the file only whole. Images, histograms and texts are not written.
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
      scalars = {("scalar/step" if name == "step" else name): value
                 for name, value in scalars.items()}
    if self._file is None:
      # Opened here, not at flush, so a bad path fails the first write.
      with self._naming_the_file():
        os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
        self._file = open(self._path, "ab")
    row = {"step": to_step(global_step)}
    row.update((name, to_number(value, name)) for name, value in scalars.items())
    line = (json.dumps(row) + "\n").encode()
    self._lines.append(line)
    self._buffered_bytes += len(line)
    if self._buffered_bytes >= _JSONL_BUFFER_BYTES:
      self.flush()

  def write_images(self, global_step: int, images: Mapping[str, Any]) -> None:
    # Refused as TensorBoard would refuse them.
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
    # Dropped before writing: a retry after a partial write would duplicate lines.
    self._lines.clear()
    self._buffered_bytes = 0
    with self._naming_the_file():
      if not self._still_at_its_path():
        raise OSError(errno.ENOENT, "moved or deleted while the run was writing it")
      self._file.write(data)
      self._file.flush()

  def _still_at_its_path(self) -> bool:
    """Whether the file open for appending is still the one at its path."""
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

    The file is cut after the last row kept, found reading back from its end
    (a torn last line goes too). Rows past `set_aside_past` (default: any, for
    a fresh start at step 0) are an earlier run's that nothing will redo: the
    whole file is moved aside instead, named in a warning.
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
