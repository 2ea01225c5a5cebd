"""Reading the files an operator hands the controller: the fleet file, catalogs, saved profiles, the lock, secrets.

Each is read with a bound far above any real one (a fleet file of a hundred boxes is some 20 KiB), so that an
endless stream (``/dev/zero``), a named pipe nobody writes or a file hundreds of megabytes long is refused at once
instead of costing minutes and gigabytes; and YAML is composed with a bound on what its aliases repeat and on how
deep it nests, so that an alias bomb or ``[[[[...]]]]`` is one line naming the file, not a MemoryError.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from controller.errors import ControllerError

KIB, MIB = 2**10, 2**20
FLEET_MAX_BYTES = 1 * MIB  # about 4000 boxes written out in full
CATALOG_MAX_BYTES = 1 * MIB  # the built-in models.yml, with its comments, is 18 KiB
PROFILE_MAX_BYTES = 1 * MIB  # `controller probe --json` of a twelve-GPU box is about 10 KiB
LOCK_MAX_BYTES = 8 * MIB  # a few KiB per box, written by the controller itself
SECRET_MAX_BYTES = 64 * KIB  # an API key or token is one line

ALIAS_MAX_VALUES = 100_000  # values that YAML aliases (*name) may repeat in one document, in all
YAML_MAX_DEPTH = 64  # collections nested in collections; a fleet file needs about 6

_READ_CHUNK = 64 * KIB

# The largest numbers an input may give. Beyond them a value is a typo, not a machine or a server: it is refused
# with one line rather than planned (a negative or astronomic figure would "fit") or left to crash a computation.
MAX_GPU_INDEX = 63  # nvidia-smi's GPU numbers on one box, 0 up to this; each index appears once
MAX_GPU_MIB = 2**24  # 16 TiB, far beyond any card's memory
MAX_CTX = 2**31 - 1  # llama.cpp reads --ctx-size (and --batch-size, --ubatch-size) as a 32-bit int
MAX_SLOTS = 256  # llama.cpp's LLAMA_MAX_SEQ: the most server slots (--parallel)
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: the most blocks a model it loads has


class TooLarge(OSError):
    """More than the bound was there to read."""


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, never more than ``limit``: a regular file or a pipe; anything else is refused.

    Raises ``OSError`` (with ``strerror`` for the operator): ``TooLarge`` beyond ``limit``, ``EINVAL`` for a
    device, socket or folder. A named pipe is opened without waiting for a writer (no writer: it reads empty).
    """
    _refuse_unless_file(os.stat(path).st_mode)  # before opening: opening a device may itself do something
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _refuse_unless_file(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)  # a pipe's writer may be slower than this reader
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(_READ_CHUNK, limit + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise TooLarge(errno.EFBIG, f"larger than {_size(limit)}, far more than any such file holds; check that "
                                    "this is the right file")
    finally:
        os.close(fd)


def _refuse_unless_file(mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise OSError(errno.EISDIR, "it is a folder; give the path of the file")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        kind = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or other special file"
        raise OSError(errno.EINVAL, f"it is {kind}, not a file; give the path of the file itself")


def read_text(path: Path, what: str, error: type[ControllerError], limit: int) -> str:
    """The UTF-8 text of ``path`` (a ``what``: "fleet file", "catalog"...), or ``error`` with one line naming it."""
    try:
        data = read_bounded(path, limit)
    except TooLarge as exc:
        raise error(f"{path}: the {what} is {exc.strerror}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}); save the {what} as UTF-8") from None


def _size(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit >= MIB else f"{limit // KIB} KiB"


class YamlRefused(yaml.YAMLError):
    """A document this loader will not build: its aliases repeat too much, refer to themselves, or it nests too
    deep. The message is one sentence, without the file's name."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias bomb, a recursive alias and nesting without end.

    Aliases cost nothing while composing (an alias is the same node again); they explode when the values are
    copied or written out. So the document's node graph is measured before anything is built from it: the
    values its aliases repeat, counted as if written out, must stay under ``ALIAS_MAX_VALUES``.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise YamlRefused(f"line {line}: nested more than {YAML_MAX_DEPTH} levels deep; no input of the "
                                  "controller needs that: flatten it")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # a date with month 13, an integer of 5000 digits
            raise yaml.constructor.ConstructorError(None, None, str(exc).split(";")[0], node.start_mark) from None

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_repetition(node)
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_repetition(root: yaml.Node) -> None:
    """Refuse a graph whose aliases repeat more than ``ALIAS_MAX_VALUES`` nodes, or that contains itself."""
    written_out: dict[int, int] = {}  # id(node) -> nodes under it (itself included) once aliases are written out
    open_nodes: set[int] = set()  # the path from the root to the node being measured
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            written_out[key] = 1 + sum(written_out[id(child)] for child in _children(node))
            continue
        if key in written_out:
            continue
        open_nodes.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise YamlRefused(f"line {child.start_mark.line + 1}: an alias refers to the value that contains "
                                  "it (a value without end); write the value out")
            if id(child) not in written_out:
                stack.append((child, False))
    repeated = written_out[id(root)] - len(written_out)
    if repeated > ALIAS_MAX_VALUES:
        raise YamlRefused(f"its aliases (*name) repeat {repeated} values, more than the {ALIAS_MAX_VALUES} the "
                          "controller accepts (a YAML alias bomb?); write the values out or use fewer aliases")


def load_yaml(text: str, source: object, error: type[ControllerError]) -> Any:
    """The YAML document in ``text``, or ``error`` with one line naming ``source`` and what is wrong."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except YamlRefused as exc:
        raise error(f"{source}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"{source}: not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from None
    except RecursionError:  # never expected: YAML_MAX_DEPTH keeps the composer far inside Python's limit
        raise error(f"{source}: nested too deeply; no input of the controller needs that: flatten it") from None
