"""Process-level coordination: who is chief, and barriers between processes."""

import jax
from jax.experimental import multihost_utils


def is_chief() -> bool:
  """Process 0 writes summaries and checkpoints unless a `*_all_hosts` key says otherwise."""
  return jax.process_index() == 0


def rendezvous(name: str = "jaxline_ng") -> None:
  """Blocks until every process reaches this point (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
