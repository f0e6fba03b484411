"""The check that ``statecore`` is the installed package, not a folder that shadows it.

Python puts the current directory first on ``sys.path``. Run from the folder above a clone
of the project named ``statecore``, ``import statecore`` finds that clone's root (a directory
without ``__init__.py``, so a namespace package) before an editable install's finder is
asked; the package's submodules still load through the finder, and the first sign is a
baffling ``cannot import name ... (unknown location)``. The entry points (``pyspark_glue``
and the ``statecore`` command) call :func:`check_package_origin` first, which says what
happened instead.
"""
import sys

__all__ = ["check_package_origin"]


def check_package_origin():
    """ImportError naming the directory if ``statecore`` was imported as a namespace package
    (a directory named ``statecore`` ahead of the installed package on ``sys.path``)."""
    module = sys.modules.get("statecore")
    if module is None or getattr(module, "__file__", None) is not None:
        return
    where = ", ".join(getattr(module, "__path__", [])) or "an unknown location"
    raise ImportError(
        f"'statecore' was imported from {where}, a directory named statecore that is not the installed package "
        f"(a clone of the project seen from the folder above it: Python puts the current directory first on "
        f"sys.path). Run from another directory, or rename the folder")
