"""jaxline_ng: the jaxline experiment framework on modern JAX."""

import re

import setuptools

with open("jaxline_ng/__init__.py") as f:
  VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

setuptools.setup(
    name="jaxline_ng",
    version=VERSION,
    description="Write experiments as jaxline did, run them on modern JAX.",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["jaxline_ng", "jaxline_ng.*"]),
    install_requires=[
        "absl-py>=2.1",
        "jax>=0.10",
        "ml-collections>=1.0",
        "numpy>=1.26",
        # Durable checkpoints (config.checkpointer = "disk").
        "orbax-checkpoint>=0.12",
        # TensorBoard writing; TF 2.21 no longer pulls in tensorboard itself.
        "tensorboard>=2.21",
        "tensorflow-cpu>=2.21",
    ],
    extras_require={
        "examples": ["dm-haiku>=0.0.16", "optax>=0.2.8", "scikit-learn>=1.5"],
        "test": ["dm-haiku>=0.0.16", "optax>=0.2.8", "pytest>=8", "scikit-learn>=1.5"],
    },
)
