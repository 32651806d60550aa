"""Mutated real MP4s (bit flips, rewritten size and count fields, truncation) only ever make the
parser raise refstream.errors exceptions — never IndexError, struct.error, MemoryError, ….

About ten seconds by default; REFSTREAM_FUZZ_EXAMPLES=<n> runs n examples per strategy.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from media import parse_index_bytes

from refstream.errors import RefstreamError

MEDIA = Path(__file__).resolve().parents[1] / "spec" / "fixtures" / "mp4"
SEEDS = ["h264_b", "h264_b_faststart", "h264_negcts", "h264_offset", "h264_audio", "av1_g2",
         "h265_b", "h264_b_co64", "h264_b_largesize", "h264_nob_uuid"]
BYTES = {name: (MEDIA / f"{name}.mp4").read_bytes() for name in SEEDS}
EXAMPLES = int(os.environ.get("REFSTREAM_FUZZ_EXAMPLES", "1500"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def moov_field_offsets(data: bytes) -> list[int]:
    """Offsets of every box size field and of the 32-bit words after full-box headers inside
    moov — where sizes, versions and entry counts live."""
    out = []

    def walk(start: int, end: int) -> None:
        pos = start
        while pos + 8 <= end:
            size, kind = struct.unpack_from(">I4s", data, pos)
            if size < 8 or pos + size > end:
                return
            out.extend([pos, pos + 8, pos + 12, pos + 16, pos + 20])
            if kind in (b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts"):
                walk(pos + 8, pos + size)
            pos += size

    walk(0, len(data))
    return [o for o in out if o + 4 <= len(data)]


FIELDS = {name: moov_field_offsets(data) for name, data in BYTES.items()}
INTERESTING = [0, 1, 7, 8, 15, 16, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 12345]


def parse_or_refstream_error(data: bytes) -> None:
    try:
        index = parse_index_bytes(data, "fuzz.mp4")
    except RefstreamError:
        return
    # whatever parses must be a coherent index
    n = len(index)
    for array in (index.dts, index.pts, index.duration, index.size, index.offset):
        assert array.shape == (n,) and array.dtype == np.int64
    assert np.all(index.offset + index.size <= len(data))


@FUZZ
@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 7)),
                                         min_size=1, max_size=8))
def test_bit_flips(name, flips):
    data = bytearray(BYTES[name])
    for where, bit in flips:
        data[where % len(data)] ^= 1 << bit
    parse_or_refstream_error(bytes(data))


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_size_and_count_fields(name, draw):
    data = bytearray(BYTES[name])
    for _ in range(draw.draw(st.integers(1, 3))):
        where = draw.draw(st.sampled_from(FIELDS[name]))
        value = draw.draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**32 - 1)))
        struct.pack_into(">I", data, where, value)
    parse_or_refstream_error(bytes(data))


@FUZZ
@given(st.sampled_from(SEEDS), st.integers(0, 2**31))
def test_truncation(name, cut):
    data = BYTES[name]
    parse_or_refstream_error(data[: cut % len(data)])
