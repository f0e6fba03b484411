"""Test helpers for a store directory's version files, whose names carry the commit id of the
attempt that wrote them (``<v>_<16 hex>.delta``): tests name them by version and kind."""
import os
import re

_ID = re.compile(r"^([0-9]+)_[0-9a-f]{16}\.")


def short_name(name):
    """``3_<id>.delta`` -> ``3.delta``; other names unchanged."""
    return _ID.sub(r"\1.", name)


def is_url(path):
    """Whether ``path`` is an fsspec URL (``s3://bucket/...``), not a local path."""
    return "://" in str(path)


def list_names(directory):
    """The names of the files in ``directory`` (a local path or an fsspec URL); [] if missing."""
    if not is_url(directory):
        return os.listdir(directory) if os.path.isdir(directory) else []
    import fsspec

    fs, path = fsspec.core.url_to_fs(directory)
    fs.invalidate_cache()
    try:
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "file"]
    except FileNotFoundError:
        return []


def version_names(directory):
    """The directory's file names with the commit ids dropped, sorted ([] if missing)."""
    return sorted(short_name(n) for n in list_names(directory))


def version_path(directory, version, kind):
    """The path of the one ``kind`` file of ``version`` (there must be exactly one)."""
    found = [n for n in list_names(directory) if short_name(n) == f"{version}.{kind}"]
    assert len(found) == 1, f"expected one {version}.{kind} in {directory}, found {found}"
    return os.path.join(directory, found[0])


def flip(path, offset):
    """Flip every bit of the byte at ``offset`` of ``path`` (a local path, or an fsspec URL:
    then the object is written again whole, as an object store has no in-place write)."""
    if is_url(path):
        import fsspec

        fs, full = fsspec.core.url_to_fs(path)
        data = bytearray(fs.cat_file(full))
        data[offset] ^= 0xFF
        fs.pipe_file(full, bytes(data))
        return
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
