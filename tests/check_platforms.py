"""Checks that jaxline_ng's dependencies resolve to wheels on the platforms JAX supports.

    python tests/check_platforms.py      # `make platforms`; needs the package index

pip evaluates environment markers for the machine it runs on, even with
`--platform` (pypa/pip#10050), so this script evaluates pyproject.toml's
markers for each target itself, then asks pip to resolve the selected
requirements for that target's wheel tags (`pip install --dry-run`).
Not collected by pytest: it downloads package metadata.
"""

import json
import os
import subprocess
import sys
import tempfile
import tomllib

from helpers import ROOT
from packaging.requirements import Requirement

TARGETS = {
    "Linux x86_64": ({"platform_system": "Linux", "platform_machine": "x86_64",
                      "sys_platform": "linux"},
                     ["manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64",
                      "manylinux_2_17_x86_64"]),
    "Linux aarch64": ({"platform_system": "Linux", "platform_machine": "aarch64",
                       "sys_platform": "linux"},
                      ["manylinux_2_27_aarch64", "manylinux_2_24_aarch64", "manylinux2014_aarch64",
                       "manylinux_2_17_aarch64"]),
    "macOS arm64": ({"platform_system": "Darwin", "platform_machine": "arm64",
                     "sys_platform": "darwin"},
                    ["macosx_14_0_arm64", "macosx_12_0_arm64", "macosx_11_0_arm64"]),
}


def requirements_for(environment: dict) -> list[str]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  # The examples' extra too: `make` installs it, and grain's wheels are per platform.
  dependencies = [*project["dependencies"], *project["optional-dependencies"]["examples"]]
  selected = []
  for line in dependencies:
    requirement = Requirement(line)
    if requirement.marker is None or requirement.marker.evaluate(environment):
      requirement.marker = None
      selected.append(str(requirement))
  return selected


def main() -> int:
  failures = 0
  for name, (environment, tags) in TARGETS.items():
    requirements = requirements_for(environment)
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
               "--ignore-installed", "--only-binary=:all:", "--python-version", "3.11",
               *[arg for tag in tags for arg in ("--platform", tag)],
               *requirements]
    with tempfile.TemporaryDirectory() as target:  # --platform requires a --target.
      result = subprocess.run([*command, "--target", target], capture_output=True, text=True)
    if result.returncode != 0:
      failures += 1
      print(f"{name}: FAILED: {result.stderr.strip().splitlines()[-1]}")
      continue
    installed = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                 for item in json.loads(result.stdout)["install"]}
    shown = ", ".join(f"{n} {installed[n]}" for n in sorted(installed)
                      if n.startswith(("tensorflow", "jax", "orbax", "grain")))
    print(f"{name}: resolves ({len(installed)} packages): {shown}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
