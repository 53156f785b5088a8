"""Random Hadamard transform signs read from a checkpoint (``rht=checkpoint`` in a cast spec).

torchao's NVFP4 training (``torchao/prototype/moe_training/nvfp4_training/nvfp4_training.py``,
pytorch/ao at 36027d8) gives every ``NVFP4Linear`` a buffer ``_rht_sign_vector``: 16 values of
+1 or -1 in ``torch.int8`` (``_make_rht_sign_vector`` lines 44-67; drawn per layer by
``hadamard_utils.get_wgrad_sign_vector`` lines 72-80, ``torch.rand(16) >= 0.5``, unless one is
given), registered ``persistent=True`` (lines 138-142), so a state dict holds it as
``<layer>._rht_sign_vector`` beside ``<layer>.weight``. Its matrix is ``diag(signs) @ H16 / 4``
(``hadamard_utils.get_rht_matrix`` lines 118-135), the one :class:`~driftcli.records.cast.Rht`
builds.

A scan resolves ``rht=checkpoint`` tensor by tensor: the tensor ``a.b.weight`` takes the
signs of ``a.b._rht_sign_vector`` in the same input. A tensor whose layer has none is refused
in one line naming it (exit 2), never given another layer's or a default vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from driftcli.errors import DriftError
from driftcli.io.readers import ReadError, TensorRef
from driftcli.records.cast import RHT_SIZE, Cast, Rht

SIGN_VECTOR = "_rht_sign_vector"
"""The buffer's name in a torchao ``NVFP4Linear`` (and so the last part of its state-dict key)."""


class SignVectorError(DriftError):
    """A tensor scanned under ``rht=checkpoint`` whose layer has no usable sign vector."""


def needs_signs(casts: Sequence[Cast]) -> bool:
    """Whether some cast takes its transform's signs from the checkpoint."""
    return any(c.rht is not None and c.rht.from_checkpoint for c in casts)


def vector_name(tensor: str) -> str:
    """The sign vector's key for ``tensor``: its layer (the name up to the last dot) followed
    by ``._rht_sign_vector`` (``layers.0.w1.weight`` -> ``layers.0.w1._rht_sign_vector``)."""
    layer, dot, _ = tensor.rpartition(".")
    return f"{layer}{dot}{SIGN_VECTOR}"


def sign_vectors(tensors: Sequence[TensorRef]) -> dict[str, TensorRef]:
    """The sign-vector tensors among ``tensors``, by name."""
    return {r.name: r for r in tensors if r.name.rpartition(".")[2] == SIGN_VECTOR}


def read_signs(ref: TensorRef) -> Rht:
    """The transform of one stored sign vector: 16 values, each +1 or -1 (any integer or float
    dtype: torchao stores int8). Anything else is refused naming the tensor."""
    where = f"{ref.source}: {ref.name}"
    if ref.numel != RHT_SIZE:
        raise SignVectorError(f"{where} has shape {list(ref.shape)}; an RHT sign vector holds "
                              f"{RHT_SIZE} values of +1 or -1")
    try:
        values = ref.read().reshape(-1).to(torch.float64).tolist()
    except (ReadError, RuntimeError, TypeError) as err:
        raise SignVectorError(f"{where} cannot be read as a sign vector ({err})") from None
    if any(v not in (1.0, -1.0) for v in values):
        raise SignVectorError(f"{where} holds {values}; an RHT sign vector holds only +1 and -1 "
                              "(is this a torchao NVFP4 checkpoint?)")
    return Rht.of_signs(tuple(int(v) for v in values))


def resolve(casts: Sequence[Cast], ref: TensorRef,
            vectors: dict[str, TensorRef]) -> tuple[Cast, ...]:
    """``casts`` for the tensor ``ref``: each ``rht=checkpoint`` replaced by the transform of
    its layer's sign vector (``vectors``: :func:`sign_vectors` of its input); the rest as
    given. Raises :class:`SignVectorError` naming the tensor when its layer has none."""
    if not needs_signs(casts):
        return tuple(casts)
    key = vector_name(ref.name)
    if key not in vectors:
        raise SignVectorError(
            f"{ref.source}: tensor {ref.name} has no sign vector {key} for rht=checkpoint; "
            f"select only the layers that have one (--include '*.weight' with --exclude) or "
            "give the signs (rht=te, rht=signs/<16 of + or ->)")
    rht = read_signs(vectors[key])
    # the layer's signs, on the tensor core the spec named (tc=), if any
    return tuple(replace(c, rht=replace(rht, core=c.rht.core))
                 if c.rht is not None and c.rht.from_checkpoint else c for c in casts)
