"""Named tensors from checkpoints and dumps, read one tensor (or a few rows) at a time.

:func:`open_inputs` lists what a set of paths holds without reading tensor data:
safetensors files (single, or sharded through ``*.safetensors.index.json``),
PyTorch ``.pt`` / ``.pth`` / ``.bin`` state dicts (``weights_only`` only), NumPy
``.npz`` / ``.npy``, and folders of any of these. Each listed tensor is a
:class:`TensorRef` whose :meth:`TensorRef.read` copies rows ``[start, stop)`` of
dim 0 into a fresh tensor, so memory stays bounded by the rows asked for.

Every header is checked before anything is read from it (safetensors as strictly as the
safetensors library; ``.npy`` / ``.npz`` shapes against the bytes really there), so no
buffer is ever sized from an unverified shape. Failures are kept as local as the file's
layout allows: a missing path raises at once; a file that cannot be opened, or whose
layout is in doubt (a corrupt header, offsets that overlap or leave gaps, a refused
pickle), becomes one entry of :attr:`Inputs.errors` and the other files are still listed;
one entry that is wrong inside a sound layout (an unknown dtype code, a shape that does not
match its bytes) is an entry naming that tensor, and its neighbours are listed. A file that
shrinks after it was listed makes ``read`` raise :class:`ReadError`. The formats, these
rules and the drift dump metadata are described in ``docs/inputs.md``.

One module per kind of file (:mod:`~driftcli.io.readers.safetensors` with its index and the
dump metadata, :mod:`~driftcli.io.readers.pytorch`, :mod:`~driftcli.io.readers.npy`), each
providing a :class:`~driftcli.io.readers.core.FileKind`; :mod:`~driftcli.io.readers.core`
holds the types they share and :mod:`~driftcli.io.readers.collect` the walk over the paths.
"""

from driftcli.io.dumps import DUMP_KEY
from driftcli.io.readers.collect import open_inputs
from driftcli.io.readers.core import InputError, Inputs, ReadError, TensorRef

__all__ = ["DUMP_KEY", "InputError", "Inputs", "ReadError", "TensorRef", "open_inputs"]
