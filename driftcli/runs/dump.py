"""``drift dump``: one training step of a checkpoint, every matmul operand recorded.

The checkpoint (a drift model, or any kind :func:`driftcli.models.loaders.load_causal_lm`
reads) runs one batch forward and backward inside :func:`driftcli.io.capture.capture`: the
activations and weights of every forward matmul and the gradient flowing into every matmul's
output, with role, layer and operand in the dump's metadata, ready for ``clip-rate``,
``underflow-rate``, ``error-bias`` and ``accum-error``. The batch is ``windows`` windows of
``context + 1`` tokens drawn from the text with ``seed``; the loss is the mean next-token
cross-entropy (the model reads the first ``context`` tokens of each window). By default the
step runs in plain float32; with ``policy`` every matmul runs under it, and the dump holds
the operands as they are before the policy casts them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import get_policy
from driftcli.errors import DriftError
from driftcli.io.capture import capture
from driftcli.models.checkpoint import read_info
from driftcli.models.loaders import CausalLM, load_causal_lm
from driftcli.runs.training import deterministic
from driftcli.text import load_corpus, recorded_corpus, sample_windows

Tensor = torch.Tensor


@dataclass(frozen=True)
class DumpResult:
    """What :func:`dump_operands` wrote."""

    path: Path
    names: tuple[str, ...]
    roles: dict[str, int]
    """Tensors written per role."""
    step: int | None
    """The checkpoint's training step (drift checkpoints), else None."""
    loss: float
    batch_shape: tuple[int, int]
    text: Path
    """The text file the batch came from."""
    kind: str
    """The checkpoint kind (``drift``, ``hf``)."""


def dump_operands(checkpoint: str | Path, out: str | Path, text: str | Path | None = None, *,
                  windows: int = 8, context: int | None = None, seed: int = 0,
                  policy: str | None = None, threads: int = 1) -> DumpResult:
    """Run one batch of ``text`` through ``checkpoint`` under :func:`capture` into ``out``
    (module docs). ``text`` defaults to the run's own text for drift checkpoints;
    ``context`` to the model's context (drift) or 128 tokens (other kinds); torch runs on
    ``threads`` threads, deterministically."""
    path = Path(checkpoint)
    if windows < 1:
        raise DriftError(f"dump: windows must be at least 1, not {windows}")
    resolved = None if policy is None else get_policy(policy)
    lm: CausalLM = load_causal_lm(path)
    step = None
    if lm.kind == "drift":
        config, state = read_info(path)
        step = int(state.get("step", 0))
        context = context or config.context
        corpus = (load_corpus(text) if text is not None
                  else recorded_corpus(state.get("text") or {}, str(path)))
    elif text is None:
        raise DriftError(f"dump: give the text for {path} with --text FILE")
    else:
        corpus = load_corpus(text)
    context = context or 128
    if lm.tokenize is None:
        raise DriftError(f"dump: {path} has no tokenizer to read text {corpus.source} with")
    if lm.kind == "drift":
        ids = corpus.data.long()  # the byte tokenizer's ids are the bytes
    else:
        ids = torch.tensor(lm.tokenize(corpus.path.read_text(encoding="utf-8",
                                                             errors="replace")),
                           dtype=torch.int64)
    batch = sample_windows(ids, windows, context + 1, torch.Generator().manual_seed(seed),
                           corpus.source, what="whole")
    model = lm.model
    model.zero_grad(set_to_none=True)
    with deterministic(threads), \
            arithmetic(resolved, model=model) if resolved is not None else nullcontext(), \
            capture(model, out, step=step) as cap:
        logits = lm.logits(model, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
    roles: dict[str, int] = {}
    for entry in cap.entries.values():
        roles[entry.role.value] = roles.get(entry.role.value, 0) + 1
    return DumpResult(Path(out), cap.names, roles, step, float(loss.detach()),
                      (int(batch.shape[0]), int(batch.shape[1])), corpus.path, lm.kind)
