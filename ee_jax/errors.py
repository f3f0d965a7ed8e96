"""Exceptions users can catch. Each message names the problem and what to do about it."""


class EEJaxError(Exception):
    """Base class of every error ee-jax raises on purpose."""


class ModelLoadError(EEJaxError, ValueError):
    """A model file or folder that cannot be loaded (missing, corrupt, unsupported)."""


class UnsupportedModelError(ModelLoadError):
    """A well-formed model that ee-jax does not implement (architecture, quantization...)."""


class TokenizationError(EEJaxError, ValueError):
    """Text the tokenizer cannot encode (not a str, or not valid Unicode such as a lone
    surrogate): the message names the position and what to send instead."""


class MemoryMapsExhausted(EEJaxError, RuntimeError):
    """The process is about to run out of memory maps (Linux's vm.max_map_count): XLA's CPU
    backend maps ~500-800 regions per compiled step program of a real model and keeps them
    while the program lives, and at the limit it crashes inside a compile (a segmentation
    fault) instead of failing cleanly."""
