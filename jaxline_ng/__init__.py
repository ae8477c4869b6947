"""jaxline_ng: the jaxline experiment framework on modern JAX.

Import the submodules you need (`from jaxline_ng import platform`); this package
file stays empty of imports so that `import jaxline_ng` costs nothing.
"""

__version__ = "0.1.0"
