"""HPACK (RFC 7541), as much as a gRPC client needs: headers sent as literals, headers
received decoded in full (static and dynamic tables, Huffman-coded strings).

How it works: :func:`encode` writes each header as a literal without indexing and without
Huffman coding (a request's few headers; nothing for the server to remember, so nothing
to keep in step). :class:`Decoder` reads a header block: indexed fields, literals with or
without indexing, dynamic table size updates; its dynamic table evicts by the RFC's
accounting (32 octets an entry beyond its name and value), and the headers a block
decodes to are bounded (``limit``: names, values and 32 octets an entry, as
SETTINGS_MAX_HEADER_LIST_SIZE counts them). The Huffman code is canonical (codes of one
length are consecutive, in symbol order), so the RFC's table is rebuilt from its code
lengths alone (:data:`_LENGTHS`, Appendix B); decoding walks the code's tree four bits at a
time through a table built once (:data:`_NEXT`, :data:`_EMIT`: for each inner node of the
tree and each nibble, the node reached and the symbols passed), a few milliseconds for the
largest header block a connection takes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["Decoder", "HpackError", "encode", "huffman_decode"]


class HpackError(ValueError):
    """A header block that is not valid HPACK."""


#: RFC 7541 Appendix A: the static table (index 1 first).
_STATIC: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode())
    for name, value in (
        (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
        (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"),
        (":status", "200"), (":status", "204"), (":status", "206"), (":status", "304"),
        (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
        ("accept-encoding", "gzip, deflate"), ("accept-language", ""),
        ("accept-ranges", ""), ("accept", ""), ("access-control-allow-origin", ""),
        ("age", ""), ("allow", ""), ("authorization", ""), ("cache-control", ""),
        ("content-disposition", ""), ("content-encoding", ""), ("content-language", ""),
        ("content-length", ""), ("content-location", ""), ("content-range", ""),
        ("content-type", ""), ("cookie", ""), ("date", ""), ("etag", ""), ("expect", ""),
        ("expires", ""), ("from", ""), ("host", ""), ("if-match", ""),
        ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
        ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""),
        ("location", ""), ("max-forwards", ""), ("proxy-authenticate", ""),
        ("proxy-authorization", ""), ("range", ""), ("referer", ""), ("refresh", ""),
        ("retry-after", ""), ("server", ""), ("set-cookie", ""),
        ("strict-transport-security", ""), ("transfer-encoding", ""), ("user-agent", ""),
        ("vary", ""), ("via", ""), ("www-authenticate", ""),
    )
)  # fmt: skip

#: RFC 7541 Appendix B: the Huffman code's length in bits of symbols 0-255 and EOS (256).
_LENGTHS = (
    "13 23 28 28 28 28 28 28 28 24 30 28 28 30 28 28 "
    "28 28 28 28 28 28 30 28 28 28 28 28 28 28 28 28 "
    "6 10 10 12 13 6 8 11 10 10 8 11 8 6 6 6 "
    "5 5 5 6 6 6 6 6 6 6 7 8 15 6 12 10 "
    "13 6 7 7 7 7 7 7 7 7 7 7 7 7 7 7 "
    "7 7 7 7 7 7 7 7 8 7 8 13 19 13 14 6 "
    "15 5 6 5 6 5 6 6 6 5 7 7 6 6 6 5 "
    "6 7 6 5 5 6 7 7 7 7 7 15 11 14 13 28 "
    "20 22 20 20 22 22 22 23 22 23 23 23 23 23 24 23 "
    "24 24 22 23 24 23 23 23 23 21 22 23 22 23 23 24 "
    "22 21 20 22 22 23 23 21 23 22 22 24 21 22 23 23 "
    "21 21 22 21 23 22 23 23 20 22 22 22 23 22 22 23 "
    "26 26 20 19 22 23 22 25 26 26 26 27 27 26 24 25 "
    "19 21 26 27 27 26 27 24 21 21 26 26 28 27 27 27 "
    "20 24 20 21 22 21 21 23 22 22 25 25 24 24 26 23 "
    "26 27 26 26 27 27 27 27 27 28 27 27 27 27 27 26 "
    "30"
)
EOS = 256


def _canonical_codes() -> dict[int, tuple[int, int]]:
    """Each symbol's (code, length): codes of one length consecutive, in symbol order."""
    lengths = [int(x) for x in _LENGTHS.split()]
    assert len(lengths) == 257
    codes: dict[int, tuple[int, int]] = {}
    code, previous = 0, 0
    for symbol in sorted(range(257), key=lambda s: (lengths[s], s)):
        code <<= lengths[symbol] - previous
        previous = lengths[symbol]
        codes[symbol] = (code, previous)
        code += 1
    return codes


CODES = _canonical_codes()


def _tree() -> tuple[list[list[int]], list[bool]]:
    """The code's tree: each inner node's two children (an inner node's index, or
    ``~symbol`` for a leaf), and whether each inner node may end a string (reached by at
    most 7 one-bits: RFC 7541 5.2's padding)."""
    children: list[list[int]] = [[0, 0]]
    pad: list[bool] = [True]
    depth: list[int] = [0]
    for symbol, (code, length) in CODES.items():
        node = 0
        for shift in range(length - 1, -1, -1):
            bit = code >> shift & 1
            if not shift:
                children[node][bit] = ~symbol
                break
            if not children[node][bit]:
                children[node][bit] = len(children)
                children.append([0, 0])
                depth.append(depth[node] + 1)
                pad.append(pad[node] and bit == 1 and depth[-1] <= 7)
            node = children[node][bit]
    return children, pad


def _nibbles() -> tuple[list[int], list[bytes], list[bool]]:
    """For each inner node and nibble: the inner node reached (:data:`_BAD` past EOS) and
    the symbols passed on the way."""
    children, pad = _tree()
    reached: list[int] = []
    passed: list[bytes] = []
    for node in range(len(children)):
        for nibble in range(16):
            at, out = node, bytearray()
            for shift in (3, 2, 1, 0):
                at = children[at][nibble >> shift & 1]
                if at < 0:
                    if ~at == EOS:
                        at = _BAD
                        break
                    out.append(~at)
                    at = 0
            reached.append(at)
            passed.append(bytes(out))
    return reached, passed, pad


_BAD = -1
_NEXT, _EMIT, _PADDING = _nibbles()


def huffman_decode(data: bytes) -> bytes:
    """A Huffman-coded string (RFC 7541 5.2: padded with at most 7 one-bits).

    Raises:
        HpackError: EOS inside the string, or padding that is not EOS's first bits.
    """
    out = bytearray()
    node = 0
    reached, passed = _NEXT, _EMIT
    for byte in data:
        index = node << 4 | byte >> 4
        node = reached[index]
        if node < 0:
            raise HpackError("EOS in a Huffman-coded string")
        out += passed[index]
        index = node << 4 | byte & 15
        node = reached[index]
        if node < 0:
            raise HpackError("EOS in a Huffman-coded string")
        out += passed[index]
    if not _PADDING[node]:
        raise HpackError("invalid padding of a Huffman-coded string")
    return bytes(out)


def _integer(value: int, prefix: int, first: int) -> bytes:
    """``value`` as an HPACK integer with a ``prefix``-bit prefix (``first``: the byte's
    other bits)."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 127 | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block: each header a literal without indexing, its strings raw."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value
    return bytes(out)


class Decoder:
    """The decoding side of one connection: its dynamic table (see the module docstring).

    Args:
        max_size: The table size this side allows (SETTINGS_HEADER_TABLE_SIZE sent).
    """

    def __init__(self, max_size: int = 4096) -> None:
        self._limit = max_size
        self._max = max_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._size = 0

    def _add(self, name: bytes, value: bytes) -> None:
        self._table.appendleft((name, value))
        self._size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max and self._table:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + 32

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HpackError(f"header index {index} out of range")
        return self._table[dynamic]

    def decode(self, block: bytes, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """The headers of one whole header block, in order.

        Args:
            block: The block.
            limit: The most the headers may add up to (names, values and 32 octets a
                header); ``None``: no limit.

        Raises:
            HpackError: The block is not valid HPACK, or its headers go over ``limit``.
        """
        headers: list[tuple[bytes, bytes]] = []
        room = float("inf") if limit is None else limit
        pos, end = 0, len(block)
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _read_integer(block, pos, 7)
                header = self._entry(index)
            elif byte & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _read_integer(block, pos, 5)
                if size > self._limit:
                    raise HpackError(f"table size {size} above the {self._limit} allowed")
                self._max = size
                self._evict()
                continue
            else:  # literal: with incremental indexing (01), without (0000), never (0001)
                indexing = bool(byte & 0x40)
                index, pos = _read_integer(block, pos, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, pos = _read_string(block, pos)
                value, pos = _read_string(block, pos)
                header = (name, value)
                if indexing:
                    self._add(name, value)
            room -= len(header[0]) + len(header[1]) + 32
            if room < 0:
                raise HpackError(f"a header list of more than {limit} bytes")
            headers.append(header)
        return headers


def _read_integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    limit = (1 << prefix) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HpackError("a truncated or oversized integer")
        byte = block[pos]
        pos += 1
        value += (byte & 127) << shift
        shift += 7
        if not byte & 128:
            return value, pos


def _read_string(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        raise HpackError("a truncated header block")
    huffman = bool(block[pos] & 0x80)
    length, pos = _read_integer(block, pos, 7)
    if pos + length > len(block):
        raise HpackError("a truncated string")
    raw = block[pos : pos + length]
    return (huffman_decode(raw) if huffman else raw), pos + length
