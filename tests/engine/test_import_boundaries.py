"""The boundary between the engine and the glue: ``statecore`` never imports ``pyspark_glue``,
``pyspark`` or ``py4j`` (checked by importing every statecore module in a fresh interpreter
where those imports fail, and by scanning the sources), and ``pyspark_glue`` uses only
public names of ``statecore``: a name in the ``__all__`` of a statecore module whose name has
no leading underscore, or a public attribute of such a name, unless :data:`GLUE_INTERNALS`
lists it with the reason the glue needs it."""
import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys

from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)
SPARK_SIDE = ("pyspark_glue", "pyspark", "py4j")

# Internals of statecore the glue may use ("module.name" or "module"), each with why.
# Empty: everything the glue touches is public. Add an entry here, with its reason, rather
# than widening a statecore module's __all__ for the glue's sake.
GLUE_INTERNALS = {}


def _sources(package, suffixes=(".py",)):
    top = os.path.join(ROOT, package)
    for folder, _dirs, files in os.walk(top):
        for name in sorted(files):
            if name.endswith(suffixes):
                yield os.path.join(folder, name)


def _imported(tree):
    """``(module, name or None, line)`` of every import in ``tree`` (absolute imports only)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name, node.lineno


def test_statecore_sources_import_nothing_of_spark():
    found = []
    cimport = re.compile(r"^\s*(?:from|c?import)\s+([\w.]+)", re.M)
    for path in _sources("statecore", (".py", ".pyx", ".pxd")):
        with open(path) as f:
            text = f.read()
        if path.endswith(".py"):
            modules = [(m, line) for m, _name, line in _imported(ast.parse(text, path))]
        else:
            modules = [(m.group(1), text.count("\n", 0, m.start()) + 1) for m in cimport.finditer(text)]
        found += [f"{os.path.relpath(path, ROOT)}:{line}: {m}" for m, line in modules
                  if m.split(".")[0] in SPARK_SIDE]
    assert not found, "statecore imports the Spark side:\n" + "\n".join(found)


BLOCKING_IMPORT = r"""
import importlib, importlib.abc, pkgutil, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"statecore must not import {{name}}")

sys.meta_path.insert(0, Blocked())
import statecore
names = sorted(m.name for m in pkgutil.walk_packages(statecore.__path__, "statecore."))
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not leaked, leaked
print(len(names))
"""


def test_every_statecore_module_imports_without_spark():
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", BLOCKING_IMPORT.format(blocked=set(SPARK_SIDE))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert int(out.stdout.split()[-1]) >= 10  # the walk found the modules (not an empty package)


def _is_public_module(module):
    return not any(part.startswith("_") for part in module.split("."))


def _public_names(module):
    return set(getattr(importlib.import_module(module), "__all__", ()))


def _statecore_uses(path):
    """``(what, line)`` of every statecore name ``path`` uses: imported names and modules,
    and attributes read from them (``registry.get``, ``EpochCoordinatorRef.create``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    bound = {}  # local name -> (statecore module, name or None for a module)
    for module, name, line in _imported(tree):
        if module.split(".")[0] != "statecore":
            continue
        if name is None:
            yield module, line
            continue
        submodule = f"{module}.{name}"
        if _is_submodule(submodule):
            bound[name] = (submodule, None)
            yield submodule, line
        else:
            bound[name] = (module, name)
            yield f"{module}.{name}", line
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            module, name = bound[node.value.id]
            yield (f"{module}.{node.attr}" if name is None else f"{module}.{name}.{node.attr}"), node.lineno


def _is_submodule(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _is_public(what):
    """Whether a dotted statecore name is public (see the module docstring)."""
    parts = what.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = ".".join(parts[:i])
        if _is_submodule(module):
            break
    rest = parts[i:]
    if not _is_public_module(module):
        return False
    if not rest:
        return True
    return rest[0] in _public_names(module) and not any(p.startswith("_") for p in rest[1:])


def test_the_glue_uses_only_public_statecore_names():
    used = {}
    for path in _sources("pyspark_glue"):
        for what, line in _statecore_uses(path):
            used.setdefault(what, []).append(f"{os.path.relpath(path, ROOT)}:{line}")
    assert used, "no statecore use found: the scan is broken"
    internal = {what: where for what, where in used.items() if not _is_public(what) and what not in GLUE_INTERNALS}
    assert not internal, "the glue uses statecore internals not listed in GLUE_INTERNALS:\n" + "\n".join(
        f"{what}: {', '.join(where)}" for what, where in sorted(internal.items()))
    unused = sorted(set(GLUE_INTERNALS) - set(used))
    assert not unused, f"GLUE_INTERNALS lists names the glue no longer uses: {unused}"


def test_the_public_name_rule_itself():
    assert _is_public("statecore.registry.get") and _is_public("statecore.files.open_store_files")
    assert _is_public("statecore.epoch.EpochCoordinatorRef.create")
    assert not _is_public("statecore.files._makedirs_durable")
    assert not _is_public("statecore.registry._lock")
    assert not _is_public("statecore.epoch.EpochCoordinatorRef._ask")
    assert not _is_public("statecore._hash")


def test_the_wheel_lists_every_package():
    """An editable install imports any folder, a wheel only the packages pyproject.toml lists:
    a package left off the list works here and is missing on the executors."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("statecore", "pyspark_glue"):
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in folder:
                found.add(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    assert found == listed


# PySpark internals (the py4j gateway, SparkSession.sparkContext, private attributes) the
# glue reaches only through pyspark_glue/spark_internals.py.
SPARK_INTERNAL_NAMES = {"_jvm", "_jsc", "_jdf", "sparkContext", "py4j", "Py4JError", "_active_spark_context",
                        "_instantiatedSession", "_jlistener", "_jrdd", "_prev_jrdd", "_jrdd_deserializer",
                        "_prev_jrdd_deserializer", "_reserialize", "_is_pipelinable", "_gateway",
                        # a SparkContext's, which a Spark Connect session lacks
                        "setJobDescription", "getLocalProperty",
                        # pyspark.sql.pandas.types, a module PySpark's API reference leaves out
                        "to_arrow_schema", "from_arrow_schema"}


def _names_in_code(path):
    """``(name, line)`` of every identifier in the code of ``path`` (comments and strings,
    docstrings among them, are not code)."""
    import tokenize
    with open(path, "rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type == tokenize.NAME:
                yield token.string, token.start[0]


def test_only_spark_internals_names_pyspark_internals():
    """A glue module that reaches into PySpark (``spark.sparkContext._jvm...``) breaks on the
    next PySpark, or under Spark Connect, without anything saying so: those uses live in one
    module, each with the versions it was checked on and its failure logged."""
    home = os.path.join(ROOT, "pyspark_glue", "spark_internals.py")
    found, at_home = [], set()
    for path in _sources("pyspark_glue"):
        for name, line in _names_in_code(path):
            if name in SPARK_INTERNAL_NAMES:
                if path == home:
                    at_home.add(name)
                else:
                    found.append(f"{os.path.relpath(path, ROOT)}:{line}: {name}")
    assert not found, "PySpark internals outside pyspark_glue/spark_internals.py:\n" + "\n".join(found)
    assert {"_jvm", "_jsc", "sparkContext"} <= at_home  # the scan reads the code


# The modules the provider's jobs are split into (docs/provider-rules.md, "The provider by job"):
# each uses the provider, its held versions and the States through their public surface.
PROVIDER_JOB_MODULES = ("maintenance.py", "commit.py", "loading.py", "version_reads.py", "stores.py",
                        "held_versions.py", "provider.py")


def _private_reads_of_others(path):
    """``(line, "owner._name")`` of each private attribute (one leading underscore, not a dunder)
    a module reads or writes on anything but ``self`` and modules."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            owner = ast.unparse(node.value)
            if not owner.startswith("self.") and owner != "super()":
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return found


def test_the_provider_jobs_touch_no_private_state_of_one_another():
    """Maintenance took the provider's lock, its newest State and its snapshot source by their
    private names (``p._lock``, ``p._snapshot_source``, ...): each job module, and the provider itself,
    now goes through the public surface of the held versions and the provider."""
    found = {name: _private_reads_of_others(os.path.join(ROOT, "statecore", name)) for name in PROVIDER_JOB_MODULES}
    assert not {name: reads for name, reads in found.items() if reads}, found


def test_the_tests_read_no_private_newest_state():
    """Tests read what a provider holds through ``describe()`` or ``provider.held``, not the
    provider's private ``_latest``."""
    pattern = re.compile(r"\._" + r"latest\b")  # split: this file does not match itself
    readers = []
    for path in [*_sources("tests"), *_sources("bench")]:
        with open(path) as f:
            if pattern.search(f.read()):
                readers.append(path)
    assert not readers, readers
