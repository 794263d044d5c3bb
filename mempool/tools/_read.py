"""Bounded reading of the files the trace readers take (mempool/tools/trace.py): a stream of
chunks or lines, inflated when gzip, never more than the caps the caller passes (trace.py's
MAX_INPUT_BYTES and MAX_LINE_BYTES), so that a gzip bomb or a line of megabytes is a clear
ValueError rather than memory exhausted."""
import json
import os
import zlib

_CHUNK = 1 << 20                # bytes inflated at a time


def _too_large(path: str, cap: int) -> ValueError:
    return ValueError(f"{path}: more than {cap:,} bytes (after decompression): "
                      "larger than mempool.tools.trace.MAX_INPUT_BYTES allows (a damaged "
                      "file or a gzip bomb? raise the constant to read a larger trace)")


def open_checked(path: str):
    """`path` opened for binary reading; a directory is a ValueError, as bad content is."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; a trace is a file")
    return open(path, "rb")


def chunks(path: str, cap: int):
    """The file's bytes in chunks, inflated when it is gzip (by its magic bytes), at most
    `cap` in all; then ``None`` if a gzip stream was truncated or damaged."""
    total = 0
    with open_checked(path) as f:
        magic = f.read(2)
        f.seek(0)
        if magic != b"\x1f\x8b":
            while True:
                data = f.read(_CHUNK)
                if not data:
                    return
                total += len(data)
                if total > cap:
                    raise _too_large(path, cap)
                yield data
        d = zlib.decompressobj(wbits=31)
        pending = b""
        at_end = False
        while True:
            if d.eof:
                # Concatenated gzip members are one stream, as gzip reads them.
                pending = d.unused_data or f.read(_CHUNK)
                if not pending:
                    return
                d = zlib.decompressobj(wbits=31)
            elif not pending:
                pending = f.read(_CHUNK)
                at_end = not pending
            try:
                # max_length bounds what one call inflates: a bomb is stopped at the cap.
                data = d.decompress(pending, _CHUNK)
            except zlib.error:
                yield None
                return
            pending = d.unconsumed_tail
            total += len(data)
            if total > cap:
                raise _too_large(path, cap)
            if data:
                yield data
            elif at_end and not d.eof:
                yield None                 # the file ends before the stream does
                return


def lines(path: str, cap: int, line_max: int):
    """The file's lines as str, without their newlines, read as a stream: each at most
    `line_max` bytes, UTF-8; a damaged gzip stream is a ValueError naming the line where the
    readable text ends."""
    buf = b""
    line = 1
    for data in chunks(path, cap):
        if data is None:
            raise ValueError(f"{path}: line {line}: the gzip stream is truncated or damaged "
                             "(readable text ends in this line)")
        buf += data
        parts = buf.split(b"\n")
        buf = parts.pop()
        for raw in parts:
            yield _decoded(raw, path, line, line_max)
            line += 1
        if len(buf) > line_max:
            raise _too_long(path, line, line_max)
    if buf:
        yield _decoded(buf, path, line, line_max)


def _too_long(path: str, line: int, line_max: int) -> ValueError:
    return ValueError(f"{path}: line {line}: longer than {line_max:,} bytes "
                      "(mempool.tools.trace.MAX_LINE_BYTES); not a trace line")


def _decoded(raw: bytes, path: str, line: int, line_max: int) -> str:
    if len(raw) > line_max:
        raise _too_long(path, line, line_max)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: line {line}: not UTF-8 text ({e.reason})") from None


def json_value(text: str, nesting: int):
    """json.loads, with nesting deeper than the parser's stack a ValueError too."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"values nested deeper than {nesting} levels") from None


def depth_ok(value, limit: int) -> bool:
    """Whether `value` (JSON or unpickled data) nests at most `limit` containers deep;
    iterative, so a value nested beyond the interpreter's stack is answered too."""
    stack = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth >= limit:
            return False
        seen += 1
        stack.extend((child, depth + 1) for child in children)
    return True
