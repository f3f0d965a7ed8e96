"""The paged KV cache: two preallocated arrays and slot-wise writes into them.

    k, v: [layers, num_pages, page_size, kv_heads, head_dim]
    or, read by a Pallas kernel (`head_major`): [kv_heads, layers, num_pages, page_size,
    head_dim]

A token at position `pos` of a sequence lives at page `page_table[pos // page_size]`, offset
`pos % page_size`. Page 0 is reserved: padding rows and padding tokens point their writes at
it and no live sequence ever reads it, so they cannot corrupt a live page.

16-bit caches on CPU. XLA's CPU backend has no 16-bit float scatter, gather or
dynamic-update-slice: it converts the *whole* operand to f32 and back around each one (seen
in the compiled HLO), so a bf16 cache was copied per layer and per step and the step time
grew with the page pool (5.8 s per step at 2,912 pages, against 45-70 ms in f32). A view
through `bitcast_convert_type` does not help (XLA materialises it). So on CPU a bf16/f16
cache is *stored* in f32 (`storage_dtype`): the values written are the model's bf16 K/V,
exact in f32, and attention casts its output back to the model dtype, so tokens are those of a
bf16 cache while every write touches only its slots. It costs twice the bytes per page,
which `bytes_per_page` reports (the engine sizes the pool from it). GPU and TPU keep the
16-bit dtype: their XLA backends scatter and gather 16-bit floats without the f32 detour (not
checked here on a GPU; `tests/test_families.py` checks the CPU steps' compiled HLO).

head_dim on TPU. A cache whose head_dim is not a multiple of 128 (SmolLM2's 64) is *stored*
with head_dim padded to 128 on TPU (`storage_head_dim`): JAX's Pallas TPU paged-attention
kernel lowers only for multiples of 128 (`attention_kernels.tpu_kernel_fits`), and without it
the XLA path moves 8-17x the K/V bytes a kernel reads (docs/roofline.md). It costs no HBM: the
TPU tiles an array's minor dimension to 128 lanes, so 64 columns take the memory of 128 in
either layout. Writes fill the extra columns with zeros (`write_slots`), and attention pads q
with zeros to match and keeps the first head_dim columns of its output
(`ee_jax.serving.paged_model.attend`): q.k and p.v are unchanged, exactly.

Head-major pools. JAX's paged-attention kernels (TPU and GPU) read pages [kv_heads,
total_pages, page_size, head_dim] through a page table. A layer-major pool [L, P, S, K, hd]
has to be copied into that layout for every layer of every step (the batch's pages, or the
layer's whole pool: about twice the K/V a step reads, in temporaries too). A pool stored
[K, L, P, S, hd] *is* that layout for all layers at once: [K, L * P, S, hd] is a free reshape
and page p of layer l is page l * P + p (`kernel_pages`), so the kernel reads the pool itself.
The engine stores the pool head-major where the attention backend is a Pallas kernel
(`head_major_for`); everything that touches the pool goes through this module's functions,
which take either.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ee_jax.models.config import ModelConfig

NULL_PAGE = 0


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v"),
                   meta_fields=("head_major",))
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, P, S, K, hd]; head_major: [K, L, P, S, hd]
    v: jax.Array  # as k
    head_major: bool = False  # static: the layout (module docstring)

    @property
    def n_layers(self) -> int:
        return self.k.shape[1 if self.head_major else 0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2 if self.head_major else 1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3 if self.head_major else 2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0 if self.head_major else 3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# The TPU's lane width: the minor dimension of an array in TPU memory is tiled by 128.
TPU_LANES = 128


def storage_head_dim(head_dim: int, platform: str | None = None) -> int:
    """The head_dim a cache is held in on `platform` (default: the default device's): on TPU
    rounded up to a multiple of 128 (module docstring), `head_dim` itself elsewhere."""
    if (platform or _platform()) == "tpu":
        return -(-head_dim // TPU_LANES) * TPU_LANES
    return head_dim


# The attention backends that read a head-major pool (module docstring).
KERNEL_BACKENDS = ("pallas_tpu", "pallas_gpu")


def head_major_for(backend: str) -> bool:
    """Whether the pool read by attention backend `backend` (a resolved name, not "auto") is
    stored head-major: for JAX's Pallas kernels, which then read it without a copy."""
    return backend in KERNEL_BACKENDS


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int,
                platform: str | None = None, head_major: bool = False) -> tuple[int, ...]:
    """[L, P, S, K, hd] (head_major: [K, L, P, S, hd]) as stored on `platform` (default: the
    default device's; `storage_head_dim`)."""
    L, K, hd = cfg.n_layers, cfg.n_kv_heads, storage_head_dim(cfg.head_dim, platform)
    return (K, L, num_pages, page_size, hd) if head_major else \
        (L, num_pages, page_size, K, hd)


def _platform(sharding=None) -> str:
    """The platform the cache will live on: that of `sharding` (one sharding or a KVCache of
    them), else the default device's."""
    if sharding is not None:
        return next(iter(jax.tree.leaves(sharding)[0].device_set)).platform
    return jax.devices()[0].platform


def storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a cache of `dtype` is held in on `platform` (default: the default device's):
    f32 for 16-bit floats on CPU (module docstring), `dtype` itself elsewhere."""
    dtype = jnp.dtype(dtype)
    platform = platform or _platform()
    if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.float32)
    return dtype


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype, platform: str | None = None) -> int:
    """Bytes of one page over all layers, K and V, as stored (`storage_dtype`,
    `storage_head_dim`)."""
    itemsize = storage_dtype(dtype, platform).itemsize
    return 2 * cfg.n_layers * page_size * cfg.n_kv_heads * \
        storage_head_dim(cfg.head_dim, platform) * itemsize


def allocate_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None,
                   sharding=None, head_major: bool = False,
                   platform: str | None = None) -> KVCache:
    """Allocate once, zero-filled, directly on the device (no host copy), in the storage
    dtype of `dtype` (default: the model's) and the storage head_dim on `platform` (default:
    that of `sharding`, else the default device's; `storage_dtype`, `storage_head_dim`),
    head-major if asked (`head_major_for`)."""
    platform = platform or _platform(sharding)
    dtype = storage_dtype(dtype or cfg.dtype, platform)
    shape = cache_shape(cfg, num_pages, page_size, platform, head_major)

    @jax.jit
    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), head_major)

    if sharding is not None:
        zeros = jax.jit(zeros, out_shardings=sharding)
    return zeros()


def write_slots(cache: KVCache, layers, pages: jax.Array, offsets: jax.Array,
                k: jax.Array, v: jax.Array) -> KVCache:
    """Write K/V at the slots (layers, pages, offsets): index arrays (or a scalar layer) that
    broadcast to one shape [...]; k, v: [..., K, hd]. Only those slots are touched (a
    scatter, in place on a donated buffer; see the module docstring for 16-bit caches on
    CPU), and for a single slot also slot 0 of the null page, so that every write is a
    scatter of two or more slots (see below). k, v narrower than the cache's head_dim (a
    padded TPU cache, `storage_head_dim`) are written with zeros in the extra columns. Every
    cache write (a layer's tokens, the early-exit back-fill) goes through here."""
    k, v = (pad_head_dim(a, cache.head_dim) for a in (k, v))
    shape = jnp.broadcast_shapes(jnp.shape(layers), pages.shape, offsets.shape)
    if math.prod(shape) == 1:  # one slot: and a second into the null page (nothing reads it)
        # XLA turns a one-slot scatter into a dynamic-update-slice, which on TPU wants the
        # pool in another layout than a scatter of two or more slots: a batch-1 step given
        # the pool in the layout of the larger buckets copied it whole in and out.
        layers = jnp.stack([jnp.reshape(layers, ()), jnp.reshape(layers, ())])
        pages = jnp.stack([pages.reshape(()), jnp.asarray(NULL_PAGE, pages.dtype)])
        offsets = jnp.stack([offsets.reshape(()), jnp.zeros((), offsets.dtype)])
        k, v = (jnp.broadcast_to(a.reshape(1, *a.shape[-2:]), (2, *a.shape[-2:]))
                for a in (k, v))
    if cache.head_major:  # [K, L, P, S, hd] at [head, layer, page, offset]: rows of hd
        # (the kv head an index too, not a window: each update is one [hd] row, which the
        # kernels' default layout takes in place, where a [K, hd] window made XLA relayout
        # the pool around each write)
        heads = jnp.arange(cache.kv_heads, dtype=jnp.int32).reshape(-1, *[1] * len(shape))
        index = (heads, *(jnp.asarray(i)[None] for i in (layers, pages, offsets)))
        k, v = jnp.moveaxis(k, -2, 0), jnp.moveaxis(v, -2, 0)  # [K, ..., hd]
    else:
        index = (layers, pages, offsets)
    return dataclasses.replace(cache, k=cache.k.at[index].set(k.astype(cache.k.dtype)),
                               v=cache.v.at[index].set(v.astype(cache.v.dtype)))


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """x [..., hd] with zeros appended up to `head_dim` columns (a padded cache's)."""
    extra = head_dim - x.shape[-1]
    if extra < 0:
        raise ValueError(f"head_dim {x.shape[-1]} does not fit a cache of head_dim {head_dim}")
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def write_layer(cache: KVCache, layer, pages: jax.Array, offsets: jax.Array,
                k: jax.Array, v: jax.Array) -> KVCache:
    """Write K/V of N tokens into `layer` (a traced scalar is fine) at (pages, offsets).

    pages, offsets: [N]; k, v: [N, K, hd]. Only those N slots are touched (a scatter, which
    XLA performs in place on a donated buffer) — never a whole-layer select.
    """
    return write_slots(cache, layer, pages, offsets, k, v)


def gather_layer(cache: KVCache, layer, page_table: jax.Array):
    """The pages of each sequence in `layer`, flattened to a token axis.

    page_table: [B, W] -> k, v: [B, W * page_size, K, hd]; token j of row b is position j.
    One gather straight from the full array (no per-layer slice copy; on a kv-head-sharded
    pool each device gathers its own heads).
    """
    if cache.head_major:  # never sharded (no mesh): the pages' row gather
        return take_pages(cache, page_table + layer * cache.num_pages)
    B, W = page_table.shape
    S = cache.page_size
    k = cache.k[layer, page_table]  # [B, W, S, K, hd]
    v = cache.v[layer, page_table]
    return (k.reshape(B, W * S, *k.shape[3:]), v.reshape(B, W * S, *v.shape[3:]))


def take_pages(cache: KVCache, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K/V of pages by their index over all layers (page p of layer l: l * P + p).

    rows: [B, N] -> k, v: [B, N * page_size, K, hd]. A row gather of the pool seen as one
    matrix of pages (a free reshape), which XLA's CPU backend runs about 3x faster than the
    5-d gather `cache.k[layer, pages]`; a head-major pool is gathered head-major and
    transposed."""
    B, N = rows.shape
    S, K, hd = cache.page_size, cache.kv_heads, cache.head_dim
    pages = cache.n_layers * cache.num_pages
    if not cache.head_major:
        def one(a):
            return jnp.take(a.reshape(pages, S * K * hd), rows, axis=0,
                            mode="clip").reshape(B, N * S, K, hd)
    else:
        def one(a):
            g = jnp.take(a.reshape(K, pages, S * hd), rows, axis=1, mode="clip")  # [K, B, N, S*hd]
            return jnp.moveaxis(g.reshape(K, B, N * S, hd), 0, 2)  # [B, N*S, K, hd]
    return one(cache.k), one(cache.v)


def kernel_pages(cache: KVCache, layer, page_table: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A head-major pool as the kernels read it, with no copy: k, v [K, L * P, S, hd] and
    the table into them for `layer` (page_table + layer * P, [B, W]); None for a
    layer-major pool (`attention_kernels.layer_pages` copies its pages)."""
    if not cache.head_major:
        return None
    K, L, P, S, hd = cache.k.shape
    return (cache.k.reshape(K, L * P, S, hd), cache.v.reshape(K, L * P, S, hd),
            page_table + layer * P)
