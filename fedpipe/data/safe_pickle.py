"""Reading the CIFAR python batch files without running anything a planted file asks for.

The CIFAR-10 and CIFAR-100 "python version" files are pickles: a dict per file, with string keys and
values that are lists of ints or strings and one uint8 numpy array (`data`, N x 3072), written with
protocol 2 under Python 2 and read with encoding="latin1". A pickle can name any importable callable
and call it while it loads (`os.system` in a `__reduce__`), and the files lie in a data folder that
someone else may have written (a shared volume, $FEDPIPE_DATA). So fedpipe never hands them to
`pickle.load`: `load_cifar_pickle` uses an unpickler whose `find_class` admits only the globals the
official files name, and refuses any other one before it is imported or called.

Admitted, and why each is harmless:

- `numpy._core.multiarray._reconstruct` (numpy 2 spelling) and `numpy.core.multiarray._reconstruct`
  (numpy 1, and the official files): makes an empty array of a given class, shape and dtype;
- `numpy.ndarray`: the only class `_reconstruct` is ever given (a subclass is refused, being another
  global); its `__setstate__` copies raw bytes into the array;
- `numpy.dtype`: builds a dtype from a type code; an object dtype would only hold objects unpickled
  by this same unpickler, and the loader refuses any array that is not uint8 anyway;
- `_codecs.encode`, for latin-1 only: how Python 3 writes `bytes` at protocol 2 (a re-pickled copy or
  a test's tiny files; the official files, written by Python 2, do not need it). Any other codec is
  refused, so no codec module is looked up.

Nothing else: no builtins (the files need none: dicts, lists, strings and ints have their own
opcodes), no `copyreg`, no numpy pickles of protocol 5 (`numpy._core.numeric._frombuffer`). A file
re-pickled at protocol 5 is refused with the global's name; re-pickle it at protocol 2.
"""

from __future__ import annotations

import io
import pickle

try:  # numpy 2
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1
    from numpy.core.multiarray import _reconstruct

import numpy as np

from fedpipe.errors import DataError


def _latin1_encode(text: object, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as Python 3's protocol-2 pickles of `bytes` call it: latin-1 text only."""
    if not isinstance(text, str) or encoding.lower().replace("_", "-") not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(
            f"_codecs.encode was called with {type(text).__name__} and codec {encoding!r}; a CIFAR batch file "
            "only encodes text with latin-1"
        )
    return text.encode("latin-1")


#: (module, name) -> the object, for every global an official CIFAR batch file (or a protocol-2
#: re-pickling of one under Python 3) names. See the module docstring.
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global that no CIFAR batch file holds; nothing of it was imported or called."""

    def __init__(self, module: str, name: str):
        self.qualified_name = f"{module}.{name}"
        super().__init__(f"refused to load {self.qualified_name}")


class CifarUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ALLOWED_GLOBALS (every GLOBAL, STACK_GLOBAL, INST, OBJ and
    extension-registry opcode goes through `find_class`)."""

    def find_class(self, module: str, name: str) -> object:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):  # TypeError: an unhashable name is no allowed name either
            raise RefusedGlobal(str(module), str(name)) from None


def load_cifar_pickle(data: bytes, where: str) -> object:
    """Unpickle one CIFAR batch file's bytes (encoding="latin1", as torchvision reads them) with
    CifarUnpickler. A refused global is a DataError naming `where` and the global; any other failure
    (a truncated or non-pickle file) propagates as the unpickler raised it."""
    try:
        return CifarUnpickler(io.BytesIO(data), encoding="latin1").load()
    except RefusedGlobal as exc:
        raise DataError(
            f"Refused to read {where}: it is a pickle that asks to load {exc.qualified_name}, which no CIFAR batch "
            "file holds (they hold only numpy uint8 arrays, lists, strings and numbers), so it was not written by the "
            "CIFAR distribution and may be an attempt to run code in this process. Nothing from it was run. Find "
            "out who wrote it, delete it, and place the official files there (or set data.download=true)."
        ) from None
