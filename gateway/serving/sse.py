"""An incremental parser of server-sent events, fed the bytes of a stream as they arrive.

It follows the WHATWG HTML standard's "Interpreting an event stream"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
a line ends with CRLF, LF or CR; a line that starts with `:` is a comment; `field: value` drops
one space after the colon; `data` lines join with LF; a blank line dispatches the event (one
whose data is empty is not dispatched); a stream's leading byte order mark is dropped. Fields
other than `event` and `data` (`id`, `retry`) are not kept: nothing here needs them.

A chunk may end anywhere (inside a field, between CR and LF of a CRLF), so the parser keeps the
incomplete line; each event it returns says where its bytes end in the stream (`end`), so a
caller that must drop one whole event (gateway/serving/usage.py strips a usage chunk the client did
not ask for) knows which bytes are that event's.
"""

from __future__ import annotations

from typing import NamedTuple

_BOM = b"\xef\xbb\xbf"


class Event(NamedTuple):
    """One dispatched event: its `event` field (b"" when it had none), its data (lines joined
    with LF), and `end`, the stream offset just past the blank line that dispatched it (when
    a chunk ended between that line's CR and LF, the event is dispatched at the CR and the LF
    is the next bytes': an event stream reads a LF there as nothing)."""

    event: bytes
    data: bytes
    end: int


class SseParser:
    """Feed it every chunk of one stream, in order; it returns the events each completes."""

    def __init__(self) -> None:
        self._line = bytearray()  # the line being read, without its end
        self._data: list[bytes] = []
        self._event = b""
        self._has_data = False
        self._offset = 0  # bytes of the stream fed so far
        self._after_cr = False  # the last byte fed ended a line with CR: a LF next is its end
        self._started = False  # past the stream's first bytes (its BOM, if any)
        self._head = bytearray()  # first bytes that may be a BOM

    def feed(self, chunk: bytes) -> list[Event]:
        base = self._offset  # the stream offset of chunk[0]
        self._offset += len(chunk)
        pos, n = 0, len(chunk)
        if not self._started:
            pos = self._skip_bom(chunk)
        if self._after_cr and pos < n:
            self._after_cr = False
            if chunk[pos] == 0x0A:  # the LF of a CRLF split across chunks
                pos += 1
        if b"\r" not in chunk:
            return self._feed_lf(chunk, pos, base)
        events: list[Event] = []
        while pos < n:
            lf = chunk.find(b"\n", pos)
            cr = chunk.find(b"\r", pos, lf if lf >= 0 else n)
            if cr >= 0:  # a CR ends the line first: CR alone or CRLF
                eol, nxt = cr, cr + 1
                if nxt == n:
                    self._after_cr = True
                elif chunk[nxt] == 0x0A:
                    nxt += 1
            elif lf >= 0:
                eol, nxt = lf, lf + 1
            else:
                self._line += chunk[pos:]
                break
            if self._line:
                line = bytes(self._line) + chunk[pos:eol]
                self._line.clear()
            else:
                line = chunk[pos:eol]
            pos = nxt
            event = self._take(line, base + pos)
            if event is not None:
                events.append(event)
        return events

    def _feed_lf(self, chunk: bytes, pos: int, base: int) -> list[Event]:
        """feed() for a chunk whose lines all end with LF (what engines send): split at once."""
        events: list[Event] = []
        segments = (chunk[pos:] if pos else chunk).split(b"\n")
        rest = segments.pop()  # after the last LF: the start of a line not yet complete
        end = base + pos
        for segment in segments:
            end += len(segment) + 1
            if self._line:
                line = bytes(self._line) + segment
                self._line.clear()
            else:
                line = segment
            event = self._take(line, end)
            if event is not None:
                events.append(event)
        if rest:
            self._line += rest
        return events

    def _skip_bom(self, chunk: bytes) -> int:
        """How many of `chunk`'s bytes are the stream's leading BOM (which may itself be split
        across chunks: bytes that may still be one are held)."""
        head = bytes(self._head) + chunk
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._head += chunk
            return len(chunk)
        self._started = True
        held = len(self._head)
        self._head.clear()
        if head.startswith(_BOM):
            return len(_BOM) - held
        self._line += head[:held]  # they were not a BOM: the first line's start
        return 0

    def _take(self, line: bytes, end: int) -> Event | None:
        """Interpret one complete line; the event it dispatches, if any."""
        if not line:
            return self._dispatch(end)
        if line.startswith(b"data: "):  # the common case, without the general split
            self._data.append(line[6:])
            self._has_data = True
            return None
        if line[0] == 0x3A:  # ":" a comment
            return None
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._has_data = True
        elif name == b"event":
            self._event = value
        return None

    def _dispatch(self, end: int) -> Event | None:
        event, data, has_data = self._event, self._data, self._has_data
        self._event, self._data, self._has_data = b"", [], False
        if not has_data:
            return None
        return Event(event, b"\n".join(data), end)
