"""Vision Transformer with dropout at the five places of the paper's ViT.

Places (same p everywhere): after patch + position embedding; on the attention weights (softmax
output); after the attention output projection; after the feed-forward GELU; after the second
feed-forward Linear. Pre-norm blocks, cls-token pooling, a LayerNorm + Linear head. Written with
plain Linear layers (no einops) so the attack engine can see every weight-bearing op.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .dropout import MaskedDropout


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, p: float) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head = heads, dim_head
        self.scale = dim_head**-0.5
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.attn_drop = MaskedDropout(p)
        self.proj = nn.Linear(inner, dim)
        self.proj_drop = MaskedDropout(p)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, t, 3, self.heads, self.dim_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (b, heads, t, dim_head)
        attn = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        attn = self.attn_drop(attn)
        out = (attn @ v).transpose(1, 2).reshape(b, t, self.heads * self.dim_head)
        return self.proj_drop(self.proj(out))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = MaskedDropout(p)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = MaskedDropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(self.norm(x))))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, mlp_dim: int, p: float) -> None:
        super().__init__()
        self.attn = Attention(dim, heads, dim_head, p)
        self.ff = FeedForward(dim, mlp_dim, p)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x)
        return x + self.ff(x)


class TokenEmbedding(nn.Module):
    """Prepends the cls token and adds the position embedding: the ViT's only free parameters,
    kept in one module so that per-job gradients of them are read off this module's output."""

    def __init__(self, num_tokens: int, dim: int) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, num_tokens, dim))

    def forward(self, tokens: Tensor) -> Tensor:
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self.pos_embedding


class ViT(nn.Module):
    def __init__(
        self,
        *,
        image_size: int,
        channels: int,
        num_classes: int,
        p: float,
        patch_size: int = 4,
        dim: int = 256,
        depth: int = 4,
        heads: int = 16,
        dim_head: int = 16,
        mlp_dim: int = 256,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not divisible by the patch size {patch_size}")
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(channels * patch_size * patch_size, dim)
        self.tokens = TokenEmbedding(num_patches + 1, dim)
        self.emb_drop = MaskedDropout(p)
        self.blocks = nn.ModuleList(Block(dim, heads, dim_head, mlp_dim, p) for _ in range(depth))
        self.head_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def patchify(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        s = self.patch_size
        x = x.reshape(b, c, h // s, s, w // s, s).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // s) * (w // s), s * s * c)

    def forward(self, x: Tensor) -> Tensor:
        x = self.emb_drop(self.tokens(self.patch_embed(self.patchify(x))))
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_norm(x[:, 0]))
