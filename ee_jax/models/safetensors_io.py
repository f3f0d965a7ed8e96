"""Writing safetensors files (exit heads, back-fill maps) as any other file is written.

`safetensors.numpy.save_file` creates its file owner-only (mode 0600), so heads or maps tuned
by one user (or baked into an image) could not be read by a server running as another. Here
the bytes are written through `open` (`ee_jax.files.write_atomic`), which applies the process
umask like every other file the library writes, and a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ee_jax.files import write_atomic


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (and string `metadata`) to `path` in the safetensors format."""
    import safetensors.numpy as st

    return write_atomic(path, st.save(tensors, metadata=metadata))
