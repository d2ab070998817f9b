"""The agent's console writer: a reader that stops costs dropped lines and a note, never a
blocked caller; what is kept keeps its order."""

from __future__ import annotations

import io
import os
import re
import time

from aelastic.agent.output import writer as _output


def test_a_stream_without_a_descriptor_is_written_at_once() -> None:
    stream = io.StringIO()
    _output.write(stream, "one\n")
    assert stream.getvalue() == "one\n"


def _drain(read_fd: int, until: bytes) -> bytes:
    got = b""
    deadline = time.monotonic() + 30
    while not got.endswith(until):
        assert time.monotonic() < deadline, got[-200:]
        got += os.read(read_fd, 1 << 20)
    return got


def test_a_pipe_nobody_reads_never_blocks_the_caller_and_gets_a_note() -> None:
    read_fd, write_fd = os.pipe()
    try:
        writer = _output._Writer(limit=256 * 1024)
        started = time.monotonic()
        writer.put(write_fd, b"first\n")
        for _ in range(10_000):  # 1 MB: the pipe (64 KiB) and the queue fill up
            writer.put(write_fd, b"x" * 99 + b"\n")
        writer.put(write_fd, b"last\n")
        assert time.monotonic() - started < 2.0  # never waited for the reader
        assert not writer.flush(0.2)  # still stuck: nobody reads
        dropped = writer.dropped
        assert dropped > 5_000
        got = _drain(read_fd, b"last\n")
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert got.startswith(b"first\n")
    notes = re.findall(rb"\[aelastic\] the console is not reading: (\d+) line\(s\) dropped", got)
    assert notes and sum(int(n) for n in notes) == dropped  # one note per run of drops
    assert got.count(b"\n") == 1 + (10_000 - dropped) + len(notes) + 1  # first, kept, last


def test_lines_keep_their_order_and_the_note_sits_where_they_were_dropped() -> None:
    read_fd, write_fd = os.pipe()
    try:
        writer = _output._Writer(limit=10)
        writer.put(write_fd, b"kept\n")
        writer.put(write_fd, b"dropped\n")  # over the limit while "kept" may still wait
        assert writer.flush(10)
        writer.put(write_fd, b"after\n")
        assert writer.flush(10)
        got = _drain(read_fd, b"after\n")
    finally:
        os.close(read_fd)
        os.close(write_fd)
    if writer.dropped:
        assert re.fullmatch(rb"kept\n\[aelastic\] .* 1 line\(s\) dropped .*\nafter\n", got), got
    else:  # the writer had written "kept" already: nothing had to be dropped
        assert got == b"kept\ndropped\nafter\n"
