"""The per-sample index of an MP4's first video track, read from its ``moov`` box (SPEC §6).

Use::

    index = parse_index(read_range, file_size, path)     # read_range(offset, length) -> bytes
    index.pts, index.dts, index.size, index.offset, index.keyframe   # numpy, decode order

:func:`parse_index` is :func:`locate_moov` (SPEC §6.2) then :func:`parse_moov` (§6.3–6.5).
:func:`walk_boxes`, :func:`read_box` and :func:`video_edit_list` also serve reports that show a
file's boxes; :func:`decoder_setup` says which files' decoders are set up alike. Words: an
*offset* is a byte position (``end``: the file offset where a box or its parent ends; ``limit``:
a position in the bytes at hand); *composition* is ``pts − dts``, in ticks.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refstream.errors import MalformedMp4, Mp4Error, ShortRead, UnsupportedMp4

__all__ = ["Box", "SampleIndex", "EditList", "parse_index", "locate_moov", "parse_moov",
           "walk_boxes", "read_box", "video_edit_list", "decoder_setup"]

ReadRange = Callable[[int, int], bytes]

# Size of each probe read: the first holds ftyp and the next box header (and a short clip's
# whole moov); a probe can reach into the payload of an mdat behind its header by this much.
PROBE_BYTES = 4096
# FFmpeg drops a whole ctts table holding a composition time beyond this magnitude (mov_read_ctts).
CTTS_LIMIT = 1 << 28


@dataclass(frozen=True)
class Box:
    """One box: its four-character type and where it lies (absolute file offsets, bytes)."""

    type: str
    offset: int  # of the size field
    header_size: int  # 8, 16 with a 64-bit size, +16 for a uuid extended type
    size: int  # whole box, header included

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_size

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, eq=False)
class SampleIndex:
    """Per-sample index of one MP4's first video track, in decode order. From the video index
    (``refstream.sidecar``) the arrays are read-only, narrower views: widen before arithmetic."""

    path: str  # for messages only
    file_size: int  # bytes
    ftyp: bytes  # the whole source ftyp box (header included), b"" if absent
    stsd: bytes  # payload of the source stsd box verbatim (after its 8-byte header)
    codec: str  # fourcc of the first sample entry, e.g. "av01", "avc1", "hvc1", "mp4v"
    width: int
    height: int
    track_id: int
    timescale: int  # media timescale (mdhd), ticks per second
    movie_timescale: int  # mvhd timescale
    dts: np.ndarray  # int64 ticks, decode order, exactly what FFmpeg/PyAV report
    pts: np.ndarray  # int64 ticks, exactly what FFmpeg/PyAV report (after edit list)
    duration: np.ndarray  # int64 ticks (stts)
    size: np.ndarray  # int64 bytes
    offset: np.ndarray  # int64 absolute file offset of each sample
    keyframe: np.ndarray  # bool (stss; absent => all True)

    def __len__(self) -> int:
        return len(self.size)

    @functools.cached_property
    def composition_range(self) -> tuple[int, int]:
        """(min, max) of ``pts − dts`` over the file, in ticks ((0, 0) when empty)."""
        composition = self.pts.astype(np.int64) - self.dts.astype(np.int64)
        return (int(composition.min()), int(composition.max())) if len(composition) else (0, 0)

    @functools.cached_property
    def reordered(self) -> bool:
        """Whether presentation order differs from decode order (B-frames)."""
        return bool(np.any(self.pts[1:] <= self.pts[:-1]))


@dataclass(frozen=True)
class EditList:
    """The accepted edit list of the video track, in the timescales of the file."""

    empty_duration: int  # movie ticks of the leading empty edit, 0 if none
    media_duration: int  # movie ticks of the media edit
    media_time: int  # media ticks where the media edit starts


# --- box walking ------------------------------------------------------------------------------


def read_box(data: bytes, pos: int, limit: int, base: int, end: int, path: str) -> Box:
    """The box (SPEC §6.1) whose header is at ``data[pos:limit]``, ``data[0]`` at ``base``."""
    where = base + pos
    if limit - pos < 8:
        raise MalformedMp4(f"{path}: truncated box header at offset {where}")
    size, raw = struct.unpack_from(">I4s", data, pos)
    kind = raw.decode("latin-1")
    header = 8
    if size == 1:
        if limit - pos < 16:
            raise MalformedMp4(f"{path}: box '{kind}' at offset {where}: truncated 64-bit size")
        size = struct.unpack_from(">Q", data, pos + 8)[0]
        header = 16
    if kind == "uuid":
        header += 16
    if size != 0 and size < header:
        raise MalformedMp4(f"{path}: box '{kind}' at offset {where}: size {size} is smaller "
                           f"than its {header}-byte header")
    size = size or end - where  # size 0: the box extends to the end of its parent
    if size < header or where + size > end:
        raise MalformedMp4(f"{path}: box '{kind}' at offset {where} (size {size}) runs past the "
                           f"end of its parent (or the file) at offset {end}")
    return Box(kind, where, header, size)


def walk_boxes(data: bytes, start: int, limit: int, base: int, path: str) -> list[Box]:
    """The boxes laid end to end in ``data[start:limit]``; ``data[0]`` is at file offset base."""
    boxes = []
    pos = start
    while pos < limit:
        boxes.append(read_box(data, pos, limit, base, base + limit, path))
        pos += boxes[-1].size
    return boxes


# FFmpeg sets a decoder up from the sample entry (codec, size, its configuration box such as
# av1C/avcC/hvcC: the extradata; colr: the colour of frames whose bitstream does not say, which
# the RGB conversion reads; pasp, fiel, ...) but for btrt, a bit rate it reports only, which
# differs between the files of one camera.
_ENTRY_BOXES_AT = 8 + 86  # stsd version, flags and entry count; a VisualSampleEntry's own fields


def decoder_setup(stsd: bytes) -> bytes:
    """``stsd`` (as :attr:`SampleIndex.stsd`) without its btrt box: files whose setups are equal
    get decoders set up alike. A description not made of plain boxes is its own setup."""
    entry_limit = 8 + int.from_bytes(stsd[8:12], "big")  # where the first sample entry ends
    try:
        boxes = walk_boxes(stsd, _ENTRY_BOXES_AT, entry_limit, 0, "sample description")
    except MalformedMp4:
        return stsd
    kept = (stsd[box.offset:box.end] for box in boxes if box.type != "btrt")
    return b"".join([stsd[:_ENTRY_BOXES_AT], *kept, stsd[entry_limit:]])


def _read(read_range: ReadRange, offset: int, length: int, path: str) -> bytes:
    data = read_range(offset, length)
    if len(data) != length:
        raise ShortRead(f"{path}: asked for bytes [{offset}, {offset + length}), got {len(data)}")
    return data


def locate_moov(read_range: ReadRange, file_size: int, path: str) -> tuple[Box, bytes, bytes]:
    """(moov box, moov bytes, ftyp bytes) found with the reads of SPEC §6.2."""
    buf, buf_at = b"", 0
    ftyp = b""
    pos = 0
    while pos < file_size:
        if not (buf_at <= pos and pos + min(16, file_size - pos) <= buf_at + len(buf)):
            buf, buf_at = _read(read_range, pos, min(PROBE_BYTES, file_size - pos), path), pos
        at = pos - buf_at
        box = read_box(buf, at, len(buf), buf_at, file_size, path)
        if box.type == "moof":
            raise UnsupportedMp4(f"{path}: fragmented MP4 ('moof' at offset {pos})")
        if box.type in ("ftyp", "moov"):
            held = buf[at : at + box.size]
            if len(held) < box.size:  # finish the box with one read of what is missing
                held += _read(read_range, pos + len(held), box.size - len(held), path)
            if box.type == "moov":
                return box, held, ftyp
            ftyp = held
        pos = box.end
    raise MalformedMp4(f"{path}: no 'moov' box in {file_size} bytes")


# --- reading boxes inside moov ----------------------------------------------------------------


class _Moov:
    """The moov bytes with helpers that turn every short read into a precise error."""

    def __init__(self, data: bytes, box: Box, path: str):
        self.data, self.box, self.path = data, box, path

    def children(self, parent: Box) -> list[Box]:
        rel = parent.payload_offset - self.box.offset
        return walk_boxes(self.data, rel, parent.end - self.box.offset, self.box.offset, self.path)

    def child(self, parent: Box, kind: str, required: bool = True) -> Box | None:
        found = [b for b in self.children(parent) if b.type == kind]
        if not found and required:
            raise self.bad(parent, f"no '{kind}' box inside")
        return found[0] if found else None

    def unpack(self, box: Box, at: int, fmt: str, field: str) -> tuple:
        """struct-unpack ``fmt`` at payload offset ``at`` of ``box``."""
        if box.header_size + at + struct.calcsize(fmt) > box.size:
            raise self.bad(box, f"too short for field {field} ({box.size} bytes)")
        return struct.unpack_from(fmt, self.data, box.payload_offset - self.box.offset + at)

    def version(self, box: Box) -> int:
        return self.unpack(box, 0, ">B", "version")[0]

    def table(self, box: Box, at: int, count: int, dtype: str, columns: int,
              field: str) -> np.ndarray:
        """``count`` rows of ``columns`` big-endian ``dtype`` values at payload offset ``at``."""
        needed = count * columns * np.dtype(dtype).itemsize
        room = box.size - box.header_size - at
        if needed > room:
            raise self.bad(box, f"{field} {count} needs {needed} bytes but the box holds {room}")
        start = box.payload_offset - self.box.offset + at
        rows = np.frombuffer(self.data, dtype, count * columns, start).astype(np.int64)
        return rows.reshape(count, columns)

    def bad(self, box: Box, message: str, error: type[Mp4Error] = MalformedMp4) -> Mp4Error:
        return error(f"{self.path}: box '{box.type}' at offset {box.offset}: {message}")


def _video_track(m: _Moov) -> Box:
    for trak in (b for b in m.children(m.box) if b.type == "trak"):
        hdlr = m.child(m.child(trak, "mdia"), "hdlr")
        if m.unpack(hdlr, 8, ">4s", "handler_type")[0] == b"vide":
            return trak
    raise UnsupportedMp4(f"{m.path}: no video track (no 'trak' with a 'vide' handler)")


def _timescale(m: _Moov, box: Box) -> int:
    at = 20 if m.version(box) == 1 else 12
    timescale = m.unpack(box, at, ">I", "timescale")[0]
    if timescale == 0:
        raise m.bad(box, "timescale is 0")
    return timescale


def _sample_entry(m: _Moov, stsd: Box) -> tuple[str, int, int]:
    """(fourcc, width, height) of the only sample entry of ``stsd``."""
    (count,) = m.unpack(stsd, 4, ">I", "entry_count")
    if count != 1:
        raise m.bad(stsd, f"{count} sample entries (exactly one is supported)", UnsupportedMp4)
    entry_size, fourcc = m.unpack(stsd, 8, ">I4s", "sample entry header")
    # VisualSampleEntry: 8-byte box header, 6 reserved, data_reference_index, 16 bytes of
    # pre_defined/reserved, then width and height (ISO/IEC 14496-12 §12.1.3).
    if entry_size < 36 or 8 + entry_size > stsd.size - stsd.header_size:
        raise m.bad(stsd, f"sample entry size {entry_size} does not fit the box")
    width, height = m.unpack(stsd, 8 + 32, ">HH", "width/height")
    return fourcc.decode("latin-1"), width, height


def _runs(m: _Moov, box: Box, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts, values) of an stts or ctts table of ``n`` samples, both read as u32."""
    (count,) = m.unpack(box, 4, ">I", "entry_count")
    rows = m.table(box, 8, count, ">u4", 2, "entry_count")
    if int(rows[:, 0].sum()) != n:
        raise m.bad(box, f"describes {int(rows[:, 0].sum())} samples, stsz has {n}")
    return rows[:, 0], rows[:, 1]


def _sizes(m: _Moov, stbl: Box, file_size: int) -> np.ndarray:
    stsz = m.child(stbl, "stsz", required=False)
    if stsz is not None:
        constant, count = m.unpack(stsz, 4, ">II", "sample_size/sample_count")
        if constant:
            if count * constant > file_size:
                raise m.bad(stsz, f"sample_count {count} × sample_size {constant} exceeds the"
                            f" file size {file_size}")
            return np.full(count, constant, dtype=np.int64)
        return m.table(stsz, 12, count, ">u4", 1, "sample_count")[:, 0]
    stz2 = m.child(stbl, "stz2", required=False)
    if stz2 is None:
        raise m.bad(stbl, "no 'stsz' or 'stz2' box inside")
    field_size, count = m.unpack(stz2, 7, ">BI", "field_size/sample_count")
    if field_size == 4:
        packed = m.table(stz2, 12, (count + 1) // 2, ">u1", 1, "sample_count")[:, 0]
        return np.stack([packed >> 4, packed & 0xF], axis=1).reshape(-1)[:count]  # high: earlier
    if field_size in (8, 16):
        return m.table(stz2, 12, count, f">u{field_size // 8}", 1, "sample_count")[:, 0]
    raise m.bad(stz2, f"field_size {field_size} is not 4, 8 or 16")


def _offsets(m: _Moov, stbl: Box, sizes: np.ndarray) -> np.ndarray:
    stco = m.child(stbl, "stco", required=False)
    co64 = m.child(stbl, "co64", required=False)
    if (stco is None) == (co64 is None):
        raise m.bad(stbl, "needs exactly one of 'stco' and 'co64'")
    chunk_box = stco or co64
    (chunk_count,) = m.unpack(chunk_box, 4, ">I", "entry_count")
    width = ">u4" if stco is not None else ">u8"
    chunk_offset = m.table(chunk_box, 8, chunk_count, width, 1, "entry_count")[:, 0]
    if width == ">u8" and np.any(chunk_offset < 0):  # read as int64: ≥ 2^63 wrapped negative
        raise m.bad(chunk_box, "a chunk offset exceeds 2^63")

    stsc = m.child(stbl, "stsc")
    (entries,) = m.unpack(stsc, 4, ">I", "entry_count")
    runs = m.table(stsc, 8, entries, ">u4", 3, "entry_count")
    first_chunk, per_chunk, description = runs[:, 0], runs[:, 1], runs[:, 2]
    if entries == 0 or first_chunk[0] != 1:
        raise m.bad(stsc, "the first entry must start at chunk 1")
    if np.any(np.diff(first_chunk) <= 0):
        raise m.bad(stsc, "first_chunk values are not increasing")
    if first_chunk[-1] > chunk_count:
        raise m.bad(stsc, f"first_chunk {first_chunk[-1]} is past the {chunk_count} chunks of"
                    f" '{chunk_box.type}'")
    if np.any(per_chunk == 0) or np.any(description != 1):
        raise m.bad(stsc, "samples_per_chunk must be ≥ 1 and sample_description_index 1")

    chunks_per_run = np.diff(np.append(first_chunk, chunk_count + 1))
    samples_per_chunk = np.repeat(per_chunk, chunks_per_run)
    placed = int(samples_per_chunk.sum())
    if placed != len(sizes):
        raise m.bad(stsc, f"places {placed} samples in {chunk_count} chunks but the sample size"
                    f" table has {len(sizes)}")
    first_of_chunk = np.cumsum(samples_per_chunk) - samples_per_chunk
    before = np.cumsum(sizes) - sizes  # bytes of earlier samples, from the first sample
    # A sample lies at its chunk's offset plus the bytes before it since the chunk's first sample.
    return np.repeat(chunk_offset - before[first_of_chunk], samples_per_chunk) + before


def _keyframes(m: _Moov, stbl: Box, n: int) -> np.ndarray:
    stss = m.child(stbl, "stss", required=False)
    if stss is None:
        return np.ones(n, dtype=bool)
    (count,) = m.unpack(stss, 4, ">I", "entry_count")
    if count == 0:  # FFmpeg then guesses keyframes by parsing; refstream does not
        raise m.bad(stss, "no sync sample listed", UnsupportedMp4)
    numbers = m.table(stss, 8, count, ">u4", 1, "entry_count")[:, 0]
    if numbers[0] < 1 or numbers[-1] > n or np.any(np.diff(numbers) <= 0):
        raise m.bad(stss, f"sync sample numbers must increase within 1..{n}")
    keyframe = np.zeros(n, dtype=bool)
    keyframe[numbers - 1] = True  # checked above; np.isin would sort, 24x as slow at 47,000
    return keyframe


def _edit_list(m: _Moov, trak: Box) -> EditList | None:
    edts = m.child(trak, "edts", required=False)
    elst = m.child(edts, "elst", required=False) if edts is not None else None
    if elst is None:
        return None
    version = m.version(elst)
    if version not in (0, 1):
        raise m.bad(elst, f"version {version} (0 and 1 are defined)", UnsupportedMp4)
    (count,) = m.unpack(elst, 4, ">I", "entry_count")
    if count == 0:
        return None
    if count > 2:
        raise m.bad(elst, f"{count} entries (at most an empty and a media edit)", UnsupportedMp4)
    fmt = ">Qqhh" if version == 1 else ">Iihh"  # duration, media_time, media_rate (int, fraction)
    step = struct.calcsize(fmt)
    entries = [m.unpack(elst, 8 + i * step, fmt, f"entry {i}") for i in range(count)]
    rate_one = all(entry[2:] == (1, 0) for entry in entries)
    if not (rate_one and entries[-1][1] >= 0 and (count == 1 or entries[0][1] == -1)):
        raise m.bad(elst, f"edit list {[e[:2] for e in entries]} with rates"
                    f" {[e[2:] for e in entries]}; only one rate-1 media edit, optionally after"
                    " one empty edit, is supported", UnsupportedMp4)
    empty = entries[0][0] if count == 2 else 0
    return EditList(empty, entries[-1][0], entries[-1][1])


def video_edit_list(moov_bytes: bytes, moov: Box, path: str) -> EditList | None:
    """The accepted edit list of the video track of a complete moov box (SPEC §6.5), or None."""
    m = _Moov(moov_bytes, moov, path)
    return _edit_list(m, _video_track(m))


def _rescale(ticks: int, to_scale: int, from_scale: int) -> int:
    """FFmpeg's av_rescale for non-negative values: round half up."""
    return (ticks * to_scale + from_scale // 2) // from_scale


def _timestamps(m: _Moov, stbl: Box, edits: EditList | None, n: int, timescale: int,
                movie_timescale: int, keyframe: np.ndarray):
    """(dts, pts, duration) int64 arrays in the media timescale (SPEC §6.4–6.5)."""
    counts, deltas = _runs(m, m.child(stbl, "stts"), n)
    duration = np.repeat(deltas, counts)
    decode = np.cumsum(duration) - duration

    ctts = m.child(stbl, "ctts", required=False)
    composition = np.zeros(n, dtype=np.int64)  # ticks pts − dts (before the shift)
    shift = 0
    if ctts is not None:
        counts, values = _runs(m, ctts, n)
        values = values.astype(np.uint32).view(np.int32).astype(np.int64)  # s32 in version 0 too
        if np.any(counts == 0):
            raise m.bad(ctts, "an entry has sample_count 0", UnsupportedMp4)
        head = values[:-2]  # FFmpeg ignores the last two entries for these two rules
        if np.any(np.abs(head) > CTTS_LIMIT):
            raise m.bad(ctts, "a composition time beyond 2^28 ticks (FFmpeg discards such a table)",
                        UnsupportedMp4)
        shift = max(0, int(-head.min())) if len(head) else 0
        composition = np.repeat(values, counts)
    presentation = decode + composition

    dts = decode - shift
    if edits is not None:
        empty = _rescale(edits.empty_duration, timescale, movie_timescale)
        length = _rescale(edits.media_duration, timescale, movie_timescale)
        _check_edit_keeps_all(m, presentation, duration, keyframe, edits.media_time, length,
                              ctts is not None)
        dts = dts + empty - max(int(presentation.min()), 0)
    pts = dts + shift + composition
    return dts, pts, duration


def _check_edit_keeps_all(m, presentation, duration, keyframe, start, length, has_ctts) -> None:
    """UnsupportedMp4 unless the edit keeps every sample (SPEC §6.5 rules 1–3)."""
    where = f"{m.path}: the edit list (media_time {start}, duration {length} media ticks)"
    outside = np.flatnonzero((presentation < start) | (presentation >= start + length))
    if len(outside):
        raise UnsupportedMp4(f"{where} leaves sample {outside[0]} (pts "
                             f"{presentation[outside[0]]}) outside the edit")
    later_key = np.flatnonzero(keyframe[1:] & (presentation[1:] <= start)) + 1
    if len(later_key):
        raise UnsupportedMp4(f"{where} starts at keyframe {later_key[0]}, not at sample 0")
    # FFmpeg's frame duration for the last sample is the edit duration itself.
    frame = np.append(duration[:-1], length)
    ending = np.flatnonzero(keyframe & (presentation + frame >= start + length))
    # With a ctts, FFmpeg reads on past the first such keyframe and stops at the second.
    nth = 1 if has_ctts else 0
    if len(ending) > nth and ending[nth] != len(presentation) - 1:
        raise UnsupportedMp4(f"{where} ends at keyframe {ending[nth]}, before the last sample")


def parse_moov(moov_bytes: bytes, moov: Box, file_size: int, ftyp: bytes, path: str) -> SampleIndex:
    """The :class:`SampleIndex` of the video track of a complete moov box (SPEC §6.3–6.5)."""
    m = _Moov(moov_bytes, moov, path)
    if m.child(moov, "mvex", required=False) is not None:
        raise m.bad(moov, "fragmented MP4 ('mvex' inside)", UnsupportedMp4)
    movie_timescale = _timescale(m, m.child(moov, "mvhd"))
    trak = _video_track(m)
    tkhd = m.child(trak, "tkhd")
    (track_id,) = m.unpack(tkhd, 20 if m.version(tkhd) == 1 else 12, ">I", "track_ID")
    mdia = m.child(trak, "mdia")
    timescale = _timescale(m, m.child(mdia, "mdhd"))
    stbl = m.child(m.child(mdia, "minf"), "stbl")
    stsd = m.child(stbl, "stsd")
    codec, width, height = _sample_entry(m, stsd)

    size = _sizes(m, stbl, file_size)
    n = len(size)
    if n == 0:
        raise UnsupportedMp4(f"{path}: the video track has no samples")
    offset = _offsets(m, stbl, size)
    past = offset + size > file_size
    if np.any(past):
        i = int(np.argmax(past))
        raise MalformedMp4(f"{path}: sample {i} at offset {offset[i]} (size {size[i]}) runs past"
                           f" the end of the file ({file_size} bytes)")
    keyframe = _keyframes(m, stbl, n)
    dts, pts, duration = _timestamps(m, stbl, _edit_list(m, trak), n, timescale,
                                     movie_timescale, keyframe)
    stsd_payload = moov_bytes[stsd.payload_offset - moov.offset : stsd.end - moov.offset]
    return SampleIndex(path=path, file_size=file_size, ftyp=ftyp, stsd=bytes(stsd_payload),
                       codec=codec, width=width, height=height, track_id=track_id,
                       timescale=timescale, movie_timescale=movie_timescale, dts=dts, pts=pts,
                       duration=duration, size=size, offset=offset, keyframe=keyframe)


def parse_index(read_range: ReadRange, file_size: int, path: str) -> SampleIndex:
    """The :class:`SampleIndex` of the file's first video track."""
    moov, moov_bytes, ftyp = locate_moov(read_range, file_size, path)
    return parse_moov(moov_bytes, moov, file_size, ftyp, path)


