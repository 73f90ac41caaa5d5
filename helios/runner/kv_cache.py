"""The paged KV cache: one preallocated tensor per layer, addressed by slot = block_id * page_size + offset.

Layout per layer: [2 (k, v), num_pages, page_size, num_kv_heads, head_dim]; a multi-head latent attention layer
(arch.mla) keeps [1, num_pages, page_size, kv_lora_rank + qk_rope_head_dim] instead: per token its latent and
shared rope key (helios.layers.mla), never per-head K/V. Dim 1 is the page in both, which is all the host and disk
tiers' page copies index. An indexed layer (QSA, arch.indexer, qwen4_exp; DSA, arch.dsa, glm5_next) adds a second
paged tensor, [1, num_pages, page_size, arch.index_dim]: each token's index key (DSA: and pool-gate logits) in the
same page and slot as its K/V, so it is kept, shared and freed with them (the host tiers copy it beside the layer's
KV: paged_tensors).
A model with full and sliding-window layers keeps the window layers' pages apart (window_layers; the engine's window
group, helios/engine/kv_groups.py): their tensors hold window_pages pages, indexed by the group's own tables.
deepseek_v4 (arch.compressed) keeps per layer (raw rows [1, pages, page_size, raw_dim], entry shares [1, num_pages,
page_size, entry_row_dim]): the first in the window group when the compressors' reach fits the window, the second in
every page (helios.layers.compressed_attention).
Attention layers only (a hybrid model's linear layers keep their state in
helios.runner.state_cache). Which pages a request owns is the engine's business (block ids arrive in the plan);
this module only owns the memory.
"""

from __future__ import annotations

import math
import mmap

import torch

from helios.core.manifest import Architecture


LAZY_ZEROS_BYTES = 1 << 20  # CPU tensors from this size on come from the kernel's zero pages (zeros)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros; on the CPU, from LAZY_ZEROS_BYTES on, a private anonymous memory map instead: the kernel's zero
    pages, each faulted in when first written. The default CPU core's 32768-token pool is 1.5 GB, which torch.zeros
    spent 0.72 s writing at start-up (`make serve`'s KV line) and held resident whether or not a request used it."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel * dtype.itemsize < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)  # the tensor keeps the map alive


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        latent_dim: int | list[int] | None = None,
        index_dim: int | None = None,
        layer_pages: list[int] | None = None,
        layer_kv_heads: list[int] | None = None,
        layer_head_dims: list[int] | None = None,
        layer_sources: list[int] | None = None,
    ):
        """latent_dim: the layers are latent layers of that many values per token (MLA; a list: per layer, as
        deepseek_v4's rows); None: k/v heads.
        index_dim: each layer also keeps that many index values per token (QSA, DSA); None: none.
        layer_kv_heads: each layer's KV heads where they differ (mimo_v2_flash's sliding layers); None: num_kv_heads.
        layer_head_dims: each layer's head_dim where they differ (gemma4's full layers); None: head_dim.
        layer_sources: KV sharing (gemma4): per attention layer, the index of the tensor it reads (num_layers
        tensors are kept; a shared layer keeps none); None: the i-th layer reads the i-th tensor."""
        self.num_pages = num_pages
        self.page_size = page_size
        layer_pages = layer_pages or [num_pages] * num_layers  # a window group's layers: their own count
        layer_kv_heads = layer_kv_heads or [num_kv_heads] * num_layers
        layer_head_dims = layer_head_dims or [head_dim] * num_layers
        latent_dims = latent_dim if isinstance(latent_dim, list) else [latent_dim] * num_layers
        shapes = [(1, page_size, latent) if latent is not None else (2, page_size, nkv, d)
                  for nkv, d, latent in zip(layer_kv_heads, layer_head_dims, latent_dims)]
        self.sources = layer_sources or list(range(num_layers))
        # NOTE: zeros, not empty: a page is only read up to a sequence's length, but never-written
        # memory must not be able to carry NaNs into a masked-out lane of a future kernel.
        self.layers = [zeros((shape[0], n, *shape[1:]), dtype, device) for n, shape in zip(layer_pages, shapes)]
        self.index_layers = [zeros((1, n, page_size, index_dim), dtype, device)
                             for n in (layer_pages if index_dim else ())]

    @property
    def layer_caches(self) -> list:
        """Per attention layer what its forward takes: the KV tensor, or (KV, index keys) for a QSA layer; a KV-shared
        layer gets its source layer's."""
        own = list(zip(self.layers, self.index_layers)) if self.index_layers else self.layers
        return [own[j] for j in self.sources]

    @property
    def paged_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose dim 1 is the page (what a page copy moves): the layers, then the index keys."""
        return self.layers + self.index_layers

    @classmethod
    def from_arch(
        cls, arch: Architecture, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
        window_pages: int = 0,
    ) -> KVCache:
        """window_pages: the window group's pages (window_layers' tensors); 0: every layer holds num_pages."""
        if arch.compressed is not None:
            return cls._compressed(arch, num_pages, page_size, dtype, device, window_pages)
        latent_dim = arch.mla.cache_dim if arch.mla is not None else None
        index_dim = arch.index_dim or None
        window = set(cls.window_layers(arch)) if window_pages else set()
        owners = arch.kv_layers  # attention layers with pages of their own (all but KV-shared ones)
        layer_pages = [window_pages if i in window else num_pages for i in owners]
        kv_heads, head_dims = zip(*(arch.kv_shape(i) for i in owners))
        sources = [owners.index(arch.kv_sources[i]) for i in arch.attention_layers] if arch.kv_sources else None
        return cls(len(owners), num_pages, page_size, arch.num_kv_heads, arch.head_dim, dtype, device,
                   latent_dim, index_dim, layer_pages, list(kv_heads), list(head_dims), sources)

    @classmethod
    def _compressed(cls, arch: Architecture, num_pages: int, page_size: int, dtype: torch.dtype,
                    device: torch.device | str, window_pages: int) -> KVCache:
        """deepseek_v4 (helios.layers.compressed_attention): per layer its raw rows (raw_dim per token; the window
        group's pages, or every page without one) and, beside them as its index tensor, its share of the compressed
        entries (entry_row_dim per token, every page)."""
        c, d, owners = arch.compressed, arch.head_dim, arch.kv_layers
        kinds = [c.layer_kinds[i] for i in owners]
        cache = cls(len(owners), num_pages, page_size, 1, d, dtype, device, [c.raw_dim(k, d) for k in kinds],
                    None, [window_pages or num_pages] * len(owners))
        cache.index_layers = [zeros((1, num_pages, page_size, c.entry_row_dim(k, d, page_size)), dtype, device)
                              for k in kinds]
        return cache

    @staticmethod
    def compressed_bytes_per_page(arch: Architecture, page_size: int, dtype: torch.dtype) -> tuple[int, int]:
        """deepseek_v4: (bytes of a page of raw rows, of a page of entry shares) across its layers (one group: a page
        holds both)."""
        c, d, kinds = arch.compressed, arch.head_dim, [arch.compressed.layer_kinds[i] for i in arch.kv_layers]
        row = page_size * dtype.itemsize
        return row * sum(c.raw_dim(k, d) for k in kinds), row * sum(c.entry_row_dim(k, d, page_size) for k in kinds)

    @staticmethod
    def window_layers(arch: Architecture) -> list[int]:
        """The layers of a window group: the sliding ones of a model that also has full ones; [] when every layer
        shares one group (no sliding layers, or only sliding ones: those keep every page). deepseek_v4: every layer
        (its raw rows) when the compressors' reach fits the window (CompressedAttentionConfig.fits_window)."""
        if arch.compressed is not None:
            return list(arch.kv_layers) if arch.compressed.fits_window() else []
        if arch.sliding_window is None or not arch.layer_types:
            return []
        sliding = [i for i in arch.kv_layers if arch.layer_types[i] == "sliding"]
        return sliding if len(sliding) < len(arch.kv_layers) else []

    @staticmethod
    def values_per_token(arch: Architecture, layer: int | None = None) -> int:
        """Values one token keeps in attention layer `layer` (None: a layer of num_kv_heads): its latent and rope
        key (MLA), else its k and v heads (V padded to head_dim); plus its index values (arch.index_dim)."""
        kv_heads, head_dim = (arch.num_kv_heads, arch.head_dim) if layer is None else arch.kv_shape(layer)
        kv = arch.mla.cache_dim if arch.mla is not None else 2 * kv_heads * head_dim
        if arch.compressed is not None:  # its entry shares' width depends on the page size
            raise ValueError("deepseek_v4's rows: KVCache.compressed_bytes_per_page")
        return kv + arch.index_dim

    @staticmethod
    def bytes_per_page(arch: Architecture, page_size: int, dtype: torch.dtype, num_layers: int | None = None,
                       layers: list[int] | None = None) -> int:
        """Bytes one page costs across the attention layers `layers`, or num_layers layers of num_kv_heads, or
        (neither) all of them; for sizing the pool from free memory."""
        if arch.compressed is not None:  # one group: a page holds both parts
            return sum(KVCache.compressed_bytes_per_page(arch, page_size, dtype))
        if layers is None and num_layers is not None:
            return num_layers * page_size * KVCache.values_per_token(arch) * dtype.itemsize
        layers = arch.kv_layers if layers is None else layers
        return sum(page_size * KVCache.values_per_token(arch, i) * dtype.itemsize for i in layers)

    def slot(self, block_ids: list[int], position: int) -> int:
        """The flat slot of token `position` of a sequence whose block table is `block_ids`."""
        return block_ids[position // self.page_size] * self.page_size + position % self.page_size
