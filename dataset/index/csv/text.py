"""What the csv module's reading means for bytes, as the fast readers check it on whole
arrays: ``str.strip``'s whitespace, and RFC 4180's quotes.

The fast readers take a file only where their rows are provably ``csv.reader``'s
(:mod:`dataset.index.csv.contract`): :func:`quotes_ok` says whether a file's quotes
are ones pyarrow reads as the csv module does, :func:`strip` strips values as
``str.strip`` does and :func:`edges_clean` says, in one look, that nothing needs it.
``tests/test_csvtext.py`` checks each against a statement of its rule.
"""

from __future__ import annotations

import numpy as np

from ..cores import in_order, on_two_threads

__all__ = ["QUOTE", "edges_clean", "quotes_ok", "strip"]

QUOTE, NL, CR = 34, 10, 13
# Bytes str.strip() removes that are ASCII (the other whitespace is not ASCII).
_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_SPACE_OR_HIGH = _SPACE.copy()
_SPACE_OR_HIGH[128:] = True


def edges_clean(buf: np.ndarray, off: np.ndarray) -> bool:
    """Whether no value of the back-to-back values ``buf[off[i]:off[i + 1]]`` (a string
    array's bytes and offsets, ``off[0] == 0``) begins or ends with a byte <= 0x20 or
    >= 0x80 (every byte :func:`strip` looks at, and a few more): where values touch,
    a value's last byte and the next one's first are one 16-bit word, so one gather
    reads both edges (10M names: 51 -> 35 ms). False says nothing: ask :func:`strip`."""
    if len(off) < 2 or off[-1] < 2 or off[-2] == off[-1]:  # (an empty last value: see strip)
        return False
    seams = np.ndarray((int(off[-1]) - 1,), dtype="<u2", buffer=buf, strides=(1,))
    # value i's last byte and value i + 1's first (an index, not take(): numpy would
    # copy the strided view first), then the first and the last byte. -1 only after an
    # empty first value, whose edges do not matter: the word it reads is harmless.
    edge = np.concatenate([seams[off[1:-1] - 1].view(np.uint8), buf[[0, int(off[-1]) - 1]]])
    edge -= np.uint8(0x21)  # (wraps) bytes 0x21-0x7f become 0-0x5e, the others above
    return int(edge.max()) < 0x5F


def strip(
    buf: np.ndarray, start: np.ndarray, end: np.ndarray, chunk: int = 1 << 16
) -> tuple[np.ndarray, np.ndarray]:
    """Value ranges without their surrounding whitespace, as ``str.strip`` strips it
    (new arrays where some range changes; one look at the edge bytes finds them)."""
    n = len(buf)
    found = []
    for lo in range(0, len(start), chunk):  # small temporaries, reused: no fresh pages
        s, e = start[lo : lo + chunk], end[lo : lo + chunk]
        edge = _SPACE_OR_HIGH[buf[np.minimum(s, n - 1)]]
        edge |= _SPACE_OR_HIGH[buf[e - 1]]
        if edge.any():
            found.append(np.flatnonzero(edge & (e > s)) + lo)
    some = np.concatenate(found) if found else ()
    if len(some):
        start, end = start.astype(np.int64), end.astype(np.int64)
        start[some], end[some] = _strip_some(buf, start[some], end[some])
    return start, end


def _strip_some(buf: np.ndarray, start: np.ndarray, end: np.ndarray):
    n = len(buf)
    for edge, step in ((start, 1), (end, -1)):
        while True:
            at = edge if step == 1 else edge - 1
            m = (start < end) & _SPACE[buf[np.clip(at, 0, n - 1)]]
            if not m.any():
                break
            edge[m] += step
    # str.strip() also removes non-ASCII whitespace (NBSP, U+3000...): rare, done in Python
    high = (buf[np.minimum(start, n - 1)] >= 128) | (buf[np.maximum(end - 1, 0)] >= 128)
    for i in np.flatnonzero((start < end) & high).tolist():
        raw = bytes(buf[start[i] : end[i]])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the caller's UTF-8 check names the file
        start[i] += len(raw) - len(text.lstrip().encode("utf-8"))
        end[i] -= len(raw) - len(text.rstrip().encode("utf-8"))
        end[i] = max(end[i], start[i])
    return start, end


def quotes_ok(a: np.ndarray, body: int, sep: int, chunk: int = 1 << 19) -> bool:
    """Whether the quotes of `a` are RFC 4180's (:func:`_roles`; the file's text starts at
    byte `body`, after a byte order mark), half a MiB at a time on two threads: no array of the
    whole file's quotes (32 MB for a 1M-row file with every field quoted), only a
    chunk's. Its temporaries (a few hundred KB) are reused from the heap; a 4 MiB
    chunk's (3 MB each) were fresh pages every time: 15,000 page faults and
    twice the time for a 1M-row file. A chunk is checked both ways (its first
    quote opening a field, or closing one), the count of quotes before it decides."""

    def check(lows) -> list[tuple[int, bool, bool]]:
        mask = np.empty(min(chunk, len(a)), dtype=bool)
        out = []  # (quotes, ok if the first opens, ok if it closes) of each chunk
        for lo in lows:
            part = a[lo : lo + chunk]
            q = np.flatnonzero(np.equal(part, QUOTE, out=mask[: len(part)]))
            q += lo
            may_open, may_close = _roles(a, q, body, sep)
            even = bool(may_open[0::2].all() and may_close[1::2].all())
            odd = bool(may_close[0::2].all() and may_open[1::2].all())
            out.append((len(q), even, odd))
        return out

    closing = False  # an odd number of quotes before the chunk: its first one closes
    for count, even, odd in in_order(on_two_threads(check, range(0, len(a), chunk))):
        if not (odd if closing else even):
            return False
        closing ^= bool(count % 2)
    return not closing  # (unterminated: csv.reader raises)


def _roles(a: np.ndarray, q: np.ndarray, body: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of the quotes at `q` may open a field, and which may close one, by RFC
    4180: an opening quote starts a field (after a separator, a ``\\n`` or at `body`)
    or is the second quote of a ``""`` escape (a quote before it, which closed); a
    closing quote ends a field (a separator, a ``\\n``, ``\\r\\n`` or the end follows)
    or is the first of an escape (a quote after it)."""
    n = len(a)
    # (a quote at either end "sees" itself: it may open, or close, there anyway)
    prev = a[np.maximum(q - 1, 0)]
    may_open = (q == body) | (prev == sep) | (prev == NL) | (prev == QUOTE)
    nxt = a[np.minimum(q + 1, n - 1)]
    may_close = (q + 1 >= n) | (nxt == sep) | (nxt == NL) | (nxt == QUOTE)
    cr = np.flatnonzero(nxt == CR)
    if len(cr):
        at = q[cr] + 2
        may_close[cr] |= (at < n) & (a[np.minimum(at, n - 1)] == NL)
    return may_open, may_close
