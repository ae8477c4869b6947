"""Checksums of a checkpoint's arrays, computed where the arrays live."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxline_ng import debugging, devices


def _words(x):
  """`x`'s bits as uint32 words (elementwise, plus a trailing axis for 8-byte types)."""
  if jnp.iscomplexobj(x):
    return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  carrier = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = x if x.dtype == carrier else jax.lax.bitcast_convert_type(x, carrier)
  return bits.astype(jnp.uint32)


@debugging.compiled
def _fingerprints(arrays):
  """Two position-weighted sums of each array's bits, mod 2**32: a checksum of
  the global value that does not depend on how it is sharded (integer sums
  reduce in any order), computed where the array lives, without a gather."""
  results = []
  for x in arrays:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
      index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = words ^ (words >> jnp.uint32(15))
    results.append(jnp.stack([
        jnp.sum(words * (odd * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32),
        jnp.sum(mixed * (odd * jnp.uint32(0x85EBCA77)), dtype=jnp.uint32)]))
  return results


def dispatch_fingerprints(arrays: list) -> list:
  """`_fingerprints` of arrays wherever they are (host arrays on the default device).

  One dispatch per array: in one program for all of them, XLA keeps each
  array's bits and weights, which both sums read, in buffers as large as the
  state, twice over.
  """
  return [_fingerprints([x])[0] for x in arrays]


def fingerprints_on_host(fingerprints: list) -> list[list[int]]:
  return [[int(v) for v in np.asarray(h)] for h in devices.first_copy_to_host(fingerprints)]
