"""Package discovery for fineslab (everything else is in pyproject.toml).

`scheduler/` holds the policies and is shipped as `fineslab.scheduler`, never as a bare top-level
`scheduler` package; setuptools' static configuration cannot find sub-packages of a remapped
folder, so they are listed here.
"""

from setuptools import find_packages, setup

SCHEDULER_PACKAGES = ["fineslab.scheduler"] + [
    f"fineslab.scheduler.{name}" for name in find_packages("scheduler")
]

setup(
    packages=find_packages(include=["fineslab", "fineslab.*"]) + SCHEDULER_PACKAGES,
    package_dir={"fineslab.scheduler": "scheduler"},
)
