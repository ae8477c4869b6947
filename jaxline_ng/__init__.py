"""jaxline_ng: the jaxline experiment framework on modern JAX.

Import the submodules you need (`from jaxline_ng import platform`). The one
import here sizes XLA's CPU thread pool before JAX can start its backend
(see `xla_cpu`); it reads environment variables and nothing else.
"""

from jaxline_ng import xla_cpu as _xla_cpu  # noqa: F401  (runs on import)

__version__ = "0.1.0"
