"""Which packages the wheel holds, found rather than listed (the rest is in pyproject.toml).

setuptools reads this file beside pyproject.toml. pyproject's `packages.find` cannot name
the one package that lives outside kvlab/: the top-level kernels/ folder, which installs as
`kvlab.kernels` (package-dir in pyproject.toml), never as a generic top-level `kernels`.
So the list is built here: every package under kvlab/, plus kernels/ and any package
under it, renamed into kvlab.kernels. tests/test_wheel.py checks the built wheel against
the tree.
"""

from setuptools import find_packages, setup

KERNELS = "kvlab.kernels"  # the package the kernels/ folder installs as

setup(
    packages=[
        *find_packages(include=["kvlab", "kvlab.*"]),
        KERNELS,
        *(f"{KERNELS}.{name}" for name in find_packages("kernels")),
    ]
)
