"""jaxline_ng's metadata lives in pyproject.toml; this file keeps `setup.py` installs working."""

import setuptools

setuptools.setup()
