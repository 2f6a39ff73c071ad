"""The program of a .pt2 archive (`models/<name>.json`), checked to be data before torch reads it.

torch's deserializer (torch/_export/serde/serialize.py, torch 2.13) and `ExportedProgram.module()` turn some
of the program's strings into code:

- every symbolic shape (`expr_str`) goes through `sympy.sympify`, which evaluates Python
  (`__import__('os').system(...)` runs);
- `guards_code` becomes the source of a Python function that is executed;
- a pytree spec (`in_spec`, `out_spec`) of a defaultdict or an enum imports the module it names;
- names end up in the Python source torch.fx generates (`getattr(self, "<name>")`), and a stack trace in a
  comment line of it, so a quote or a carriage return in them would end the string or the comment.

`check_program` allows only what fedpipe's exporters write: shape expressions of a small grammar (numbers,
shape symbols, arithmetic and sympy's named functions; no attribute, no string but a symbol's name, no
power), no guards, pytree specs of tuples, lists and dicts, plain names, and free text (stack traces, module
paths) only in metadata, without control characters.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fedpipe.errors import CorruptArtifactError

MAX_PROGRAM_NODES = 2_000_000  # JSON values in a program: ~100 per graph node, far beyond any network fedpipe serves
MAX_EXPR_CHARS = 2000
MAX_NAME_CHARS = 4096

#: Symbols torch names shapes with (torch/utils/_sympy/symbol.py prefix_str), then a number.
SYMBOL = re.compile(r"(?:s|u|zf|zuf|ps|tmp|idx|i|x|y|z|h|r0_|r1_|indirect|view)[0-9]+")
#: The functions and constants a shape expression may call or name: the deserializer's own sympy functions
#: (less the powers and the left shift, whose operands could be made to take any amount of memory) and sympy's.
EXPR_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "positive", "negative", "nonnegative", "nonpositive", "integer", "real",
    "finite", "True", "False", "oo", "zoo", "nan", "Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "Abs", "floor", "ceiling", "Piecewise", "ITE", "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv",
    "CeilToInt", "FloorToInt", "CeilDiv", "RShift", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    # sympy's own spelling of a runtime assert's condition (draft_export's, for FedMN), as srepr writes it
    "Add", "Mul", "Equality", "Unequality", "LessThan", "StrictLessThan", "GreaterThan", "StrictGreaterThan", "ExprCondPair",
    "true", "false", "BooleanTrue", "BooleanFalse", "Infinity", "NegativeInfinity", "Zero", "One", "NegativeOne", "Half",
})
EXPR_TOKEN = re.compile(r"\s+|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<number>[0-9]{1,30}(?:\.[0-9]{1,30})?(?:[eE][+-]?[0-9]{1,3})?)"
                        r"|(?P<quoted>'[A-Za-z0-9_]{1,40}')|(?P<op>\*\*|[-+*/%(),<>=!&|~])")
#: Strings read as free text, never names in generated code (metadata; string arguments of ops, which torch.fx writes
#: with repr), each still without control characters.
FREE_TEXT = frozenset({"stack_trace", "nn_module_stack", "torch_fn", "source_fn_stack", "custom", "from_node", "as_string"})
NOT_IN_NAMES = re.compile(r"[\"'\\()\[\]{}#`]|[\x00-\x1f\x7f\x85\u2028\u2029]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x85\u2028\u2029]")  # \n and \t are allowed in free text
PYTREE_TYPES = frozenset({None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"})


def check_program(tree: Any, where: str) -> None:
    """Refuse (CorruptArtifactError naming `where` and the field) a program holding anything torch would run."""
    stack: list[tuple[str, str, Any]] = [("", "", tree)]
    seen = 0
    while stack:
        path, key, value = stack.pop()
        seen += 1
        if seen > MAX_PROGRAM_NODES:
            raise _refused(where, f"its program holds more than {MAX_PROGRAM_NODES:,} values")
        if key == "guards_code":
            if value not in ([], None):
                raise _refused(where, f"{path} holds Python guard code, which torch would execute")
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_name(str(k), f"{path}.{k}", where)
                stack.append((f"{path}.{k}", k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", key, v) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_string(key, value, path, where)


def _check_string(key: str, value: str, path: str, where: str) -> None:
    if key == "expr_str":
        check_expression(value, where, path)
    elif key in ("in_spec", "out_spec"):
        _check_pytree(value, path, where)
    elif key in FREE_TEXT:
        if CONTROL.search(value):
            raise _refused(where, f"{path} holds a control character (it would break out of a comment in generated code)")
    else:
        _check_name(value, path, where)


def _check_name(value: str, path: str, where: str) -> None:
    if len(value) > MAX_NAME_CHARS or NOT_IN_NAMES.search(value):
        raise _refused(where, f"{path} is not a plain name ({value[:60]!r}: quotes, brackets, backslashes and control "
                              "characters would end a string in the Python code torch generates from it)")


def check_expression(text: str, where: str, path: str = "") -> None:
    """A symbolic shape `sympy.sympify` may read: the tokens of EXPR_TOKEN, names of EXPR_NAMES or SYMBOL, quoted
    symbol names only, no power. Anything else would be evaluated as Python."""
    if len(text) > MAX_EXPR_CHARS:
        raise _refused(where, f"the shape expression at {path} is {len(text)} characters long (at most {MAX_EXPR_CHARS})")
    position = 0
    while position < len(text):
        match = EXPR_TOKEN.match(text, position)
        if match is None:
            raise _refused(where, f"the shape expression {text[:80]!r} at {path} holds {text[position]!r}, which is not arithmetic "
                                  "(sympy would evaluate it as Python)")
        name, op = match.group("name"), match.group("op")
        if name is not None and name not in EXPR_NAMES and not SYMBOL.fullmatch(name):
            raise _refused(where, f"the shape expression {text[:80]!r} at {path} names {name!r}, which is neither a shape symbol "
                                  "nor a function of shapes (sympy would evaluate it as Python)")
        if op == "**":
            raise _refused(where, f"the shape expression {text[:80]!r} at {path} raises to a power (its value could take any amount "
                                  "of memory)")
        position = match.end()


def _check_pytree(text: str, path: str, where: str) -> None:
    """A pytree spec of tuples, lists and dicts whose contexts are plain keys (torch imports the module named
    by a defaultdict's or an enum's context)."""
    try:
        protocol, root = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        raise _refused(where, f"{path} is not a pytree spec") from None
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or node.get("type") not in PYTREE_TYPES:
            kind = node.get("type") if isinstance(node, dict) else type(node).__name__
            raise _refused(where, f"{path} holds a pytree node of type {kind!r} (only tuples, lists and dicts are served)")
        context = node.get("context")
        try:
            keys = json.loads(context) if isinstance(context, str) else context
        except (ValueError, RecursionError):
            raise _refused(where, f"{path} holds a pytree context that is not JSON") from None
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, (str, int)) for k in keys)):
            raise _refused(where, f"{path} holds a pytree context that is not a list of keys")
        stack.extend(node.get("children_spec") or [])
    if not isinstance(protocol, int):
        raise _refused(where, f"{path} is not a pytree spec")


def _refused(where: str, why: str) -> CorruptArtifactError:
    return CorruptArtifactError(f"{where} is refused: {why}. fedpipe's exporters never write that; the file was "
                                "changed or made by something else. Nothing was loaded from it; export the run again.")
