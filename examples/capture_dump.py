"""Capture every matmul operand of one training step of a tiny MLP into a drift dump.

Run: python examples/capture_dump.py dump.safetensors
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from driftcli.io.capture import capture


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


torch.manual_seed(0)
model = MLP()
batch = torch.randn(32, 8)

with capture(model, sys.argv[1], step=0) as cap:
    loss = model(batch).square().mean()
    loss.backward()

# one line per tensor: name, role, and the matmul operands it feeds
for name in cap.names:
    entry = cap.entries[name]
    print(f"{name:18s} {entry.role:10s} {entry.operand}")
