"""A small causal transformer with a real KV cache, for the kvtier examples.

It is what a serving engine's model looks like to kvtier, minus the size: token embeddings,
pre-norm decoder layers with rotary attention and an MLP, and a per-layer K/V cache filled by
prefill and decode. Weights are random (a fixed seed), so the numbers mean nothing, but the
arithmetic is the real thing: a prefill costs O(tokens x params + tokens^2 x width), while
loading the same tokens' KV is a memcpy, which is exactly the trade kvtier makes.

The block layout is the one kvtier stores: one block is the K and V of ``block_size``
consecutive tokens across *all* layers, packed as ``(layers, 2, block_size, heads, head_dim)``
in one contiguous row, so one key names one self-contained piece of the prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "ModelConfig", "TinyTransformer"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 1024
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_mlp: int = 1024
    max_len: int = 8192
    block_size: int = 32
    prefill_chunk: int = 512
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def block_numel(self) -> int:
        """float32 elements in one block: K and V of block_size tokens in every layer."""
        return self.n_layers * 2 * self.block_size * self.n_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * 4

    @property
    def namespace(self) -> bytes:
        """Everything that changes the KV bytes of the same tokens goes into the key space."""
        return (
            f"tiny-transformer/seed={self.seed}/d={self.d_model}/h={self.n_heads}/"
            f"l={self.n_layers}/v={self.vocab_size}/float32/lk2bhd/bs={self.block_size}"
        ).encode()


class KVCache:
    """One sequence's cache: ``k`` and ``v`` are ``(layers, max_len, heads, head_dim)``."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        shape = (config.n_layers, max_len, config.n_heads, config.head_dim)
        self.config = config
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.length = 0

    def scatter_blocks(self, blocks: torch.Tensor, n_blocks: int) -> None:
        """Write ``blocks[:n_blocks]`` (rows of ``block_numel``) to the first positions of the
        cache, the way an engine copies loaded blocks into its per-layer KV tensors."""
        c = self.config
        if n_blocks == 0:
            return
        packed = blocks[:n_blocks].view(
            n_blocks, c.n_layers, 2, c.block_size, c.n_heads, c.head_dim
        )
        tokens = n_blocks * c.block_size
        # (n, L, 2, bs, H, D) -> (L, n * bs, H, D) for K and for V
        self.k[:, :tokens] = (
            packed[:, :, 0].transpose(0, 1).reshape(c.n_layers, tokens, -1, c.head_dim)
        )
        self.v[:, :tokens] = (
            packed[:, :, 1].transpose(0, 1).reshape(c.n_layers, tokens, -1, c.head_dim)
        )
        self.length = tokens

    def gather_blocks(self, first: int, last: int) -> torch.Tensor:
        """Blocks ``first`` .. ``last - 1`` packed as rows of ``block_numel`` (a new tensor)."""
        c = self.config
        n = last - first
        start, stop = first * c.block_size, last * c.block_size
        assert stop <= self.length, "gathering blocks past the filled part of the cache"
        k = self.k[:, start:stop].reshape(c.n_layers, n, c.block_size, c.n_heads, c.head_dim)
        v = self.v[:, start:stop].reshape(c.n_layers, n, c.block_size, c.n_heads, c.head_dim)
        packed = torch.stack((k, v), dim=2).transpose(0, 1)  # (n, L, 2, bs, H, D)
        return packed.reshape(n, c.block_numel).contiguous()


class TinyTransformer(torch.nn.Module):
    """Pre-norm decoder with rotary attention; random weights from ``config.seed``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.prefill_chunk = config.prefill_chunk
        gen = torch.Generator().manual_seed(config.seed)
        d, m = config.d_model, config.d_mlp

        def param(*shape: int, scale: float) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.randn(*shape, generator=gen) * scale, requires_grad=False
            )

        self.embed = param(config.vocab_size, d, scale=1.0)
        self.wqkv = torch.nn.ParameterList(
            [param(d, 3 * d, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.wo = torch.nn.ParameterList(
            [param(d, d, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.w1 = torch.nn.ParameterList(
            [param(d, m, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.w2 = torch.nn.ParameterList(
            [param(m, d, scale=1 / math.sqrt(m)) for _ in range(config.n_layers)]
        )
        self.unembed = param(d, config.vocab_size, scale=1 / math.sqrt(d))
        half = config.head_dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(config.max_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` of shape (tokens, heads, head_dim) for absolute positions start..."""
        n = x.shape[0]
        cos = self.cos[start : start + n, None, :]  # type: ignore[index]
        sin = self.sin[start : start + n, None, :]  # type: ignore[index]
        x1, x2 = x[..., ::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., ::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    @torch.inference_mode()
    def forward_tokens(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run ``tokens`` (1-D) after the ``cache.length`` cached ones, appending their K/V to
        the cache; return the next-token logits of the last position.

        Long inputs run as a chunked prefill (``prefill_chunk`` tokens at a time), as serving
        engines do, so the attention scores of one chunk stay small.
        """
        if cache.length + tokens.shape[0] > cache.k.shape[1]:
            raise ValueError(
                f"sequence of {cache.length + tokens.shape[0]} tokens does not fit a cache of "
                f"{cache.k.shape[1]}"
            )
        logits = torch.empty(0)
        for first in range(0, tokens.shape[0], self.prefill_chunk):
            logits = self._chunk(tokens[first : first + self.prefill_chunk], cache)
        return logits

    def _chunk(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        c = self.config
        start = cache.length
        n = tokens.shape[0]
        end = start + n
        x = self.embed[tokens]
        # query i (absolute position start + i) may see keys 0 .. start + i
        visible = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
        scale = 1.0 / math.sqrt(c.head_dim)
        for layer in range(c.n_layers):
            h = F.rms_norm(x, (c.d_model,))
            q, k, v = (h @ self.wqkv[layer]).view(n, 3, c.n_heads, c.head_dim).unbind(1)
            q, k = self._rope(q, start), self._rope(k, start)
            cache.k[layer, start:end] = k
            cache.v[layer, start:end] = v
            keys = cache.k[layer, :end].transpose(0, 1)  # (H, end, D)
            values = cache.v[layer, :end].transpose(0, 1)
            # Plain matmul attention: on a small CPU it beats the fused kernel at head_dim 64.
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * scale  # (H, n, end)
            if visible is not None:
                scores.masked_fill_(~visible, float("-inf"))
            attn = scores.softmax(dim=-1) @ values  # (H, n, D)
            x = x + attn.transpose(0, 1).reshape(n, c.d_model) @ self.wo[layer]
            h = F.rms_norm(x, (c.d_model,))
            x = x + F.gelu(h @ self.w1[layer]) @ self.w2[layer]
        cache.length = end
        last = F.rms_norm(x[-1], (c.d_model,))
        return last @ self.unembed
