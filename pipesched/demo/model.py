"""The demo's model: a byte-level GPT written as one ``nn.Sequential`` whose layers pipesched cuts into stages
(token+position embedding, N pre-norm transformer blocks, final norm, LM head), and its loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """Token ids (B, T) int64 -> token + position embedding (B, T, C)."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        for table in (self.token, self.position):  # GPT-2's init: small enough for the tied head's logits
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # (T,)
        return self.token(ids) + self.position(positions)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        x = x + self.drop(self.proj(y))  # (B, T, C)
        return x + self.drop(self.mlp(self.ln2(x)))  # (B, T, C)


def make_gpt(vocab: int, context: int, width: int, depth: int, heads: int, dropout: float,
             tied: bool = True) -> nn.Sequential:
    """The whole model as one nn.Sequential: ids (B, T) int64 -> logits (B, T, vocab) float32.

    ``tied``: the LM head's weight is the token embedding's (GPT-2's weight tying): one ``nn.Parameter`` used by
    the first and the last layer, which pipesched keeps on both ranks and sums the gradients of (``TIE_REDUCE``).
    """
    embedding, head = Embedding(vocab, context, width), nn.Linear(width, vocab)
    if tied:
        head.weight = embedding.token.weight  # (vocab, width)
    return nn.Sequential(embedding, *[Block(width, heads, dropout) for _ in range(depth)], nn.LayerNorm(width), head)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy: logits (B, T, V), targets (B, T) int64 -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(model: nn.Sequential, prompt: bytes, length: int, context: int, seed: int) -> str:
    """Sample ``length`` bytes after ``prompt`` from the whole model, in one process."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)  # (1, T)
    for _ in range(length):
        logits = model(ids[:, -context:])[:, -1]  # (1, V)
        probs = torch.softmax(logits / 0.8, dim=-1)  # (1, V)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)  # (1, T+1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")
