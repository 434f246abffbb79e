"""torchtitan_ext: the framework layer, with the checkout's ``kernels/`` and ``experiments/``
folders as its ``torchtitan_ext.kernels`` and ``torchtitan_ext.experiments`` sub-packages.

An install (``pip install .`` or ``pip install -e .``) maps the two folders through setup.py's
``package_dir``. Run from a checkout without an install (``PYTHONPATH=<checkout>``), this
package maps them itself: a sub-package missing beside this file is loaded from the folder of
the same name one level up. The import names stay under ``torchtitan_ext``, so the unrelated
PyPI ``kernels`` and ``experiments`` distributions never collide with them.
"""

import importlib.util
import sys
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE_DIR.parent
_CHECKOUT_FOLDERS = ("kernels", "experiments")


def _map_checkout_folder(name: str) -> None:
    """Load ``<checkout>/<name>`` as ``torchtitan_ext.<name>`` unless an install provides it."""
    full_name = f"{__name__}.{name}"
    folder = _CHECKOUT / name
    if full_name in sys.modules or (_PACKAGE_DIR / name).is_dir() or not (_CHECKOUT / "setup.py").is_file():
        return
    if importlib.util.find_spec(full_name) is not None:
        return
    spec = importlib.util.spec_from_file_location(
        full_name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[full_name] = module
    spec.loader.exec_module(module)


for _name in _CHECKOUT_FOLDERS:
    _map_checkout_folder(_name)
