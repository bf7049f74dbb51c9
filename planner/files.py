"""Writing user-visible files: never over an existing one unless asked, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from planner.errors import PlannerError


def check_writable(path: Path, *, force: bool) -> None:
    """A clear error, before any work is done, if `path` cannot or may not be written."""
    if path.is_dir():
        raise PlannerError("bad-path", f"{str(path)!r} is a folder; give a file name.",
                           [f"e.g. {str(path / ('name' + (path.suffix or '.json')))!r}"])
    if path.exists() and not force:
        raise PlannerError("file-exists", f"{str(path)!r} already exists; it was left as it is.",
                           ["add --force to overwrite it", "choose another file name"])
    if not path.parent.is_dir():  # Path("x").parent is Path(".")
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise PlannerError("bad-path", f"{str(path)!r} cannot be written: "
                               f"{str(blocking)!r} is a file, not a folder.",
                               ["choose another path"])
        raise PlannerError("bad-path", f"Folder {str(path.parent)!r} does not exist.",
                           ["create it first", "choose another path"])
    try:  # a folder may refuse new files (read-only, /proc) even to root, whom os.access lets by
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise PlannerError("bad-path", f"{str(path)!r} cannot be written: folder "
                           f"{str(path.parent)!r} takes no new files ({exc.strerror or exc}).",
                           ["choose another path"]) from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: Path, text: str, *, force: bool) -> None:
    """Write all of `text` or nothing (a Ctrl-C never leaves half a file)."""
    check_writable(path, force=force)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
