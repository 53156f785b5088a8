"""The drift dump format: the metadata that makes a safetensors file a dump of one training step.

A dump's ``__metadata__`` holds, under :data:`DUMP_KEY`, the JSON
``{"version": 1, "tensors": {name: {"role", "layer", "operand", "step"}}}``: one
:class:`DumpEntry` per tensor. :mod:`driftcli.io.capture` writes it and
:mod:`driftcli.io.readers` reads it; ``docs/capture.md`` describes the names and the operand
strings.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

DUMP_KEY = "drift.dump"
"""The ``__metadata__`` key of a safetensors file that marks it as a drift dump; its value is
the dump's JSON description."""
DUMP_VERSION = 1
"""The version of that JSON this drift writes and reads; a reader refuses other versions."""


class Role(StrEnum):
    """What a captured tensor is to the training step."""

    ACTIVATION = "activation"
    """An operand that is not a parameter of the model (an input, a hidden state, q or k)."""
    WEIGHT = "weight"
    """A parameter of the model (or a view of one, such as ``W.T``), recorded once per layer."""
    GRADIENT = "gradient"
    """The gradient flowing into a matmul's output during backward (dY)."""


ROLES: tuple[Role, ...] = tuple(Role)
"""Every role, in the order messages list them: what a capture records by default."""


@dataclasses.dataclass(frozen=True)
class DumpEntry:
    """The metadata of one tensor in a drift dump."""

    role: Role
    """Activation, weight or gradient."""
    layer: str
    """Qualified module name (``blocks.0.attn``), or ``<root>`` / ``<outside>``."""
    operand: str
    """Space-separated ``pass.side`` tokens naming which matmul operands the tensor feeds:
    pass is ``forward``, ``dgrad`` or ``wgrad``, side ``lhs`` or ``rhs``
    (docs/arithmetic.md#roles)."""
    step: int | None
    """The training step given to ``capture``, or ``None``."""

    def to_json(self) -> dict[str, Any]:
        """This entry as the JSON object stored in the dump's metadata."""
        return {"role": self.role.value, "layer": self.layer, "operand": self.operand,
                "step": self.step}


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DumpEntry))
"""The fields of one tensor's JSON entry, which a reader copies onto the tensor it lists."""
