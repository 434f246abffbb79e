"""Installs the three source folders under one import namespace.

``kernels/`` and ``experiments/`` share their names with unrelated PyPI
distributions, so they install as ``torchtitan_ext.kernels`` and
``torchtitan_ext.experiments``. Packages are discovered here, so adding an
experiment folder needs no edit to any central file.
"""

from setuptools import find_packages, setup

PACKAGE_ROOTS = {
    "torchtitan_ext": "torchtitan_ext",
    "torchtitan_ext.kernels": "kernels",
    "torchtitan_ext.experiments": "experiments",
}


def discover_packages() -> list[str]:
    packages = []
    for import_name, folder in PACKAGE_ROOTS.items():
        packages.append(import_name)
        packages += [f"{import_name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(packages)


setup(
    packages=discover_packages(),
    package_dir=PACKAGE_ROOTS,
    package_data={"torchtitan_ext": ["assets/*/*"]},
    include_package_data=True,
)
