"""Files written whole or not at all.

A reader (a server loading heads, a restart loading compiled programs) must never see half a
file, and two writers (threads, processes) must not interleave: the bytes go to a temporary
file of the writer's own beside the target, renamed into place. It is opened like any file,
so the process umask sets its permissions.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path`, replacing it in one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
