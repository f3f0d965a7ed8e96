"""Writing safetensors files (exit heads, back-fill maps) as any other file is written.

`safetensors.numpy.save_file` creates its file owner-only (mode 0600), so heads or maps tuned
by one user (or baked into an image) could not be read by a server running as another. Here
the bytes are written through `open`, which applies the process umask like every other file
the library writes, via a temporary file renamed into place so a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (and string `metadata`) to `path` in the safetensors format."""
    import safetensors.numpy as st

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(st.save(tensors, metadata=metadata))
    os.replace(tmp, path)
    return path
