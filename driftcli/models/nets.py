"""The reference models: a tanh MLP language model and a small transformer, both byte-level.

Both read int64 byte ids of shape ``(windows, tokens)`` and return next-byte logits of shape
``(windows, tokens, 256)``: the logits at position t predict byte t + 1 from bytes ≤ t.

- :class:`MLPLM` (the plain model of the seed study, after Bengio et al. 2003): the
  embeddings of the last ``context`` bytes (left-padded with byte 0 at the start of a window),
  concatenated, then ``layers`` hidden layers ``tanh(W·h + b)``, then a linear map to the
  logits. Every position is one example, computed independently.
- :class:`TransformerLM`: token and learned position embeddings, ``layers`` pre-norm blocks
  (LayerNorm, causal multi-head attention, LayerNorm, an MLP with GELU or tanh), a final
  LayerNorm and an untied linear head. Attention is written with explicit matmuls
  (``q @ kᵀ``, then ``p @ v``), so an arithmetic policy casts them and a capture records
  their operands.

Every matmul is an ``nn.Linear`` or a ``@``; the embeddings are lookups, not matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from driftcli.models.config import (
    VOCAB,
    Activation,
    MLPConfig,
    ModelConfig,
    ModelError,
    TransformerConfig,
)

Tensor = torch.Tensor

class ByteTokenizer:
    """Text to its UTF-8 bytes and back: no files, no special tokens, vocabulary 256."""

    vocab_size = VOCAB

    @staticmethod
    def encode(text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int] | Tensor) -> str:
        """Ids back to text (invalid UTF-8 sequences become U+FFFD)."""
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return bytes(int(i) for i in values).decode("utf-8", errors="replace")


def _check_ids(ids: Tensor, context: int | None) -> None:
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ModelError(f"the model reads integer ids of shape (windows, tokens), not "
                         f"{ids.dtype} {tuple(ids.shape)}")
    if context is not None and ids.shape[1] > context:
        raise ModelError(f"{ids.shape[1]} tokens per window is more than the model's context "
                         f"of {context}; use windows of at most {context} tokens")


class MLPLM(nn.Module):
    """The tanh MLP language model (module docs)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab, c.embed)
        widths = [c.context * c.embed] + [c.hidden] * c.layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))
        self.head = nn.Linear(c.hidden, c.vocab)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``(windows, tokens, vocab)`` for ids ``(windows, tokens)``."""
        _check_ids(ids, None)
        c = self.config.context
        # position t sees bytes t-c+1 .. t; before the window's start, byte 0
        windows = F.pad(ids, (c - 1, 0)).unfold(1, c, 1)
        h = self.embed(windows).flatten(2)
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.head(h)


@dataclass(frozen=True)
class AttentionTensors:
    """What one call of :class:`Attention` computed, as an :data:`AttentionWatch` sees it."""

    qk: Tensor
    """The product ``q·kᵀ`` ``(windows, heads, tokens, tokens)``: the first attention matmul's
    output, whose gradient is that matmul's dY."""
    scores: Tensor
    """``q·kᵀ / sqrt(head width)``: the logits the softmax reads (before the mask)."""
    keep: Tensor
    """The causal mask ``(tokens, tokens)``: True where a query sees a key."""
    probs: Tensor
    """The softmax output P: the left operand of the second matmul ``P·v``."""
    pv: Tensor
    """The product ``P·v``, whose gradient is the second matmul's dY."""


AttentionWatch = Callable[[str, AttentionTensors], None]
"""Called by every :class:`Attention` with its qualified name and its tensors, where set
(:func:`watch_attention`); it must not change them."""


class Attention(nn.Module):
    """Causal multi-head self-attention with explicit matmuls."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.watch: tuple[str, AttentionWatch] | None = None
        """The qualified name and the callback of :func:`watch_attention`, while it runs."""

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))
        qk = q @ k.transpose(-2, -1)
        scores = qk * (1 / math.sqrt(d // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        pv = probs @ v
        if self.watch is not None:
            name, call = self.watch
            call(name, AttentionTensors(qk, scores, causal, probs, pv))
        return self.proj(pv.transpose(1, 2).reshape(b, t, d))


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has an :class:`Attention` layer (the attention probes need one)."""
    return any(isinstance(m, Attention) for m in model.modules())


@contextmanager
def watch_attention(model: nn.Module, call: AttentionWatch) -> Iterator[None]:
    """Within the block, every :class:`Attention` of ``model`` hands ``call`` its qualified
    name and its :class:`AttentionTensors` on each forward (the attention probes read them);
    nothing the model computes changes."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
    for name, module in found:
        module.watch = (name, call)
    try:
        yield
    finally:
        for _, module in found:
            module.watch = None


class MLP(nn.Module):
    """The transformer block's MLP."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        width = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, width)
        self.out = nn.Linear(width, config.d_model)
        self.act = torch.tanh if config.activation is Activation.TANH else F.gelu

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """The small transformer (module docs)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.context, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        for name, p in self.named_parameters():
            # GPT-2's initialisation: small normal weights, the residual outputs scaled down
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``(windows, tokens, vocab)`` for ids ``(windows, tokens)``."""
        _check_ids(ids, self.config.context)
        x = self.embed(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(config: ModelConfig) -> nn.Module:
    """A freshly initialised model of ``config`` (seed torch first for a reproducible one)."""
    if isinstance(config, MLPConfig):
        return MLPLM(config)
    if isinstance(config, TransformerConfig):
        return TransformerLM(config)
    raise ModelError(f"not a model config: {type(config).__name__}")


def count_matmuls(config: ModelConfig) -> int:
    """Matmuls one forward pass runs (each has a dgrad and a wgrad in backward)."""
    if isinstance(config, MLPConfig):
        return config.layers + 1
    return 6 * config.layers + 1  # qkv, q·kᵀ, p·v, proj, fc, out per block; the head


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def next_byte_loss(model: nn.Module, windows: Tensor) -> Tensor:
    """Mean cross-entropy of predicting bytes 1..n of each window from the bytes before them
    (the model reads the first n of the n + 1 bytes)."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
