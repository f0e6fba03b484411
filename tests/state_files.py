"""Test helpers for a store directory's version files, whose names carry the commit id of the
attempt that wrote them (``<v>_<16 hex>.delta``): tests name them by version and kind."""
import os
import re

_ID = re.compile(r"^([0-9]+)_[0-9a-f]{16}\.")


def short_name(name):
    """``3_<id>.delta`` -> ``3.delta``; other names unchanged."""
    return _ID.sub(r"\1.", name)


def version_names(directory):
    """The directory's file names with the commit ids dropped, sorted ([] if missing)."""
    if not os.path.isdir(directory):
        return []
    return sorted(short_name(n) for n in os.listdir(directory))


def version_path(directory, version, kind):
    """The path of the one ``kind`` file of ``version`` (there must be exactly one)."""
    found = [n for n in os.listdir(directory) if short_name(n) == f"{version}.{kind}"]
    assert len(found) == 1, f"expected one {version}.{kind} in {directory}, found {found}"
    return os.path.join(directory, found[0])


def flip(path, offset):
    """Flip every bit of the byte at ``offset`` of ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def put_in_place(path, what):
    """Replace ``path`` (if it exists) by what a user or an attacker may leave where a file
    should be: ``"fifo"``, ``"dev_zero"`` (a link to /dev/zero), ``"loop"`` (a link to
    itself: ELOOP) or ``"directory"``."""
    if os.path.lexists(path):
        os.unlink(path)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dev_zero":
        os.symlink("/dev/zero", path)
    elif what == "loop":
        os.symlink(path, path)
    elif what == "directory":
        os.mkdir(path)
    else:
        raise ValueError(f"unknown replacement {what!r}")


def tree(root):
    """Every file under ``root``, with its size and modification time: equal before and after
    a command that must write nothing."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (st.st_size, st.st_mtime_ns)
    return out
