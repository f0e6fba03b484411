"""Build statecore's compiled core: the Cython modules under ``statecore/``.

Environment variables that change the build:

``STATECORE_DEBUG=1``
    ``-O0 -g`` with ``-Wall -Wextra -Werror``: a compiler warning in our code fails the build.
``STATECORE_WERROR=1``
    the release build (``-O3``) with ``-Wall -Wextra -Werror``: what CI installs, so that one
    compile both checks for warnings and is the build the tests run.
``STATECORE_SANITIZE=1``
    AddressSanitizer and UndefinedBehaviorSanitizer at ``-O1 -g`` (run Python with the ASan
    runtime preloaded: ``.ci/asan``).
``STATECORE_MODULES=_hash,_delta``
    builds only the named modules (a development convenience for parallel work).
``STATECORE_ANNOTATE=1``
    writes Cython's HTML annotation next to each ``.pyx``.
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MODULES = ["_hash", "_rowtable", "_snapshot", "_snapshot_format", "_snapshot_writer", "_snapshot_reader",
           "_snapshot_pack", "_snapshot_image", "_mapping", "_delta", "_delta_format", "_rowcodec", "_rowcalls",
           "_keyfilter", "_image_walk", "_versions", "_lock", "_grouping", "_spark_hash",
           "_float_keys", "_row_convert", "_converted_image"]

# Warnings that Cython's generated code raises on its own; silenced by name so that
# -Werror still catches ours.
CYTHON_NOISE = ["-Wno-unused-function", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _compile_args():
    args = ["-std=c11"]
    if _flag("STATECORE_DEBUG"):
        args += ["-O0", "-g", "-Wall", "-Wextra", "-Werror", *CYTHON_NOISE]
    elif _flag("STATECORE_SANITIZE"):
        # -O1: the sanitizers' own advice (readable reports), and a fraction of -O3's compile time
        args += ["-O1", "-g", "-Wall", *CYTHON_NOISE]
    elif _flag("STATECORE_WERROR"):
        args += ["-O3", "-Wall", "-Wextra", "-Werror", *CYTHON_NOISE]
    else:
        args += ["-O3", "-Wall", *CYTHON_NOISE]
    if _flag("STATECORE_SANITIZE"):
        args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    return args


def _link_args():
    return ["-fsanitize=address,undefined"] if _flag("STATECORE_SANITIZE") else []


def _extensions():
    wanted = [m for m in os.environ.get("STATECORE_MODULES", "").split(",") if m]
    names = wanted or MODULES
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        raise SystemExit(f"STATECORE_MODULES names unknown modules: {unknown}")
    return [
        Extension(
            f"statecore.{name}",
            [f"statecore/{name}.pyx"],
            include_dirs=[numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=_compile_args(),
            extra_link_args=_link_args(),
        )
        for name in names
    ]


JOBS = os.cpu_count() or 1  # modules are translated and compiled in parallel


class CythonizeThenBuild(build_ext):
    """Translates the ``.pyx`` files to C only when the extensions are built: making the sdist,
    whose inputs are the ``.pyx`` files themselves (MANIFEST.in), runs no Cython."""

    def build_extensions(self):
        translated = cythonize(
            self.extensions,
            compiler_directives={"language_level": 3, "embedsignature": True, "binding": True},
            annotate=_flag("STATECORE_ANNOTATE"),
            nthreads=JOBS,
        )
        for ext, c_ext in zip(self.extensions, translated, strict=True):
            ext.sources = c_ext.sources
        super().build_extensions()


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": CythonizeThenBuild},
    options={"build_ext": {"parallel": JOBS}},
)
