"""A GGUF file opened once a process.

gguf's reader parses every metadata field in Python (SmolLM2's 49,152-token vocabulary and
merges: ~4 s). The weights' loader, the tokenizer and the ahead-of-time plan each open the
file, so the reader is kept (keyed by size and mtime: a file rewritten in place is read
again). Light on purpose: the tokenizer imports it without JAX.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ee_jax.errors import ModelLoadError


def open_reader(path: str | os.PathLike):
    """A `gguf.GGUFReader` of the file at `path`, checked (there, GGUF, not truncated); a
    file already opened by this process, unchanged since, is not parsed again."""
    path = Path(path)
    if not path.is_file():
        hint = " (it is a folder: pass the .gguf file inside it)" if path.is_dir() else ""
        raise ModelLoadError(f"GGUF file not found: {path}{hint}. Check the path, or pass a "
                             "registry name such as 'smollm2-135m-instruct'.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'. "
                             "Pass a .gguf model file (llama.cpp format).")
    st = path.stat()
    return _reader(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/IndexError/KeyError/... on bad bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file: it is truncated or corrupt ({type(e).__name__}: "
            f"{e}). Download it again (compare its size/checksum with the source).") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {end} bytes but the file has "
                             f"{size}. Download it again.")
    return reader
