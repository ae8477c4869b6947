"""The base class of errors the platform reports in one line."""


class OneLineError(Exception):
  """An error whose message names its culprit (a flag, config key, value, file
  or process) and says all there is to say: the platform prints it as one
  line and exits 1, without a traceback. Subclasses also derive from the
  built-in error they are (ValueError, OSError, ...), so code that catches
  that still catches them."""
