#!/usr/bin/env bash
# What Spark executors need, packed for spark.archives: a venv holding statecore's wheel, its
# runtime dependencies and the executor extra (pyarrow, pandas), packed by venv-pack.
#
#   tools/pack_executor_env.sh [--extras LIST] WHEEL ARCHIVE [ENV_DIR]
#
# --extras: the wheel's extras to install, comma-separated (default: executor); executor,s3 adds
# s3fs, for state on S3 (docs/object-storage.md).
#
# then, for the application (docs/cluster.md, "Getting it onto the executors"):
#   --conf spark.archives=ARCHIVE#env --conf spark.pyspark.python=./env/bin/python
#
# The venv is made by the running python (ENV_DIR, kept, default a temporary one), so bin/python
# in the archive links to that interpreter's absolute path: the same Python must be at the same
# path on every node. Only binary wheels are installed: no compiler is needed, here or there.
# Needs venv-pack in the running python (the test extra has it).
set -euo pipefail
extras="executor"
if [[ $# -ge 2 && "$1" == "--extras" ]]; then
    extras="$2"
    shift 2
    if [[ ! "$extras" =~ ^[a-z0-9_-]+(,[a-z0-9_-]+)*$ ]]; then
        echo "pack_executor_env: --extras takes extras' names separated by commas, got '$extras'" >&2
        exit 3
    fi
fi
if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 [--extras LIST] WHEEL ARCHIVE [ENV_DIR]" >&2
    exit 3
fi
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
archive="$2"
if [[ ! -f "$wheel" || "$wheel" != *.whl ]]; then
    echo "pack_executor_env: $1 is not a wheel file" >&2
    exit 3
fi
if [[ $# -eq 3 ]]; then
    env_dir="$3"
else
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    env_dir="$scratch/env"
fi

# No pip or setuptools in the venv (the running python's pip installs into it), and no .pyc
# compiled here: both would only make the archive bigger and slower to build and unpack.
python -m venv --without-pip "$env_dir"
python -m pip --python "$env_dir/bin/python" install --quiet --no-compile --only-binary :all: "$wheel[$extras]"
# level 1: the archive is made once per build and unpacked on every executor; its size hardly changes
python -m venv_pack --quiet --force --compress-level 1 --prefix "$env_dir" --output "$archive"
echo "$archive"
