"""refstream.mp4 against FFmpeg: every real fixture's index equals the packet table that PyAV's
demuxer and ``ffprobe -show_packets`` report; malformed files raise their specific error; moov is
found with few small reads that never touch media payload."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
from media import parse_index_bytes

from refstream import errors
from refstream.mp4 import parse_index, walk_boxes
from refstream.tools.adapters import kind_mp4_index

MEDIA = Path(__file__).resolve().parents[1] / "spec" / "fixtures" / "mp4"
DESCRIPTIONS = {p.stem: json.loads(p.read_text()) for p in sorted(MEDIA.glob("*.json"))}
GOOD = [name for name, d in DESCRIPTIONS.items() if "error" not in d]
BAD = [name for name, d in DESCRIPTIONS.items() if "error" in d]


def packet_table_pyav(path: Path) -> np.ndarray:
    """(pts, dts, size, pos, keyframe) of every video packet, as PyAV's demuxer reports them."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rows = [(p.pts, p.dts, p.size, p.pos, p.is_keyframe)
                for p in container.demux(stream) if p.size]  # the last packet is an empty flush
    return np.array(rows, dtype=np.int64)


def packet_table_ffprobe(path: Path) -> np.ndarray:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_packets", "-show_entries",
         "packet=pts,dts,size,pos,flags", "-of", "json", str(path)],
        check=True, capture_output=True, text=True).stdout
    rows = [(int(p["pts"]), int(p["dts"]), int(p["size"]), int(p["pos"]), p["flags"][0] == "K")
            for p in json.loads(out)["packets"]]
    return np.array(rows, dtype=np.int64)


def index_table(data: bytes, name: str) -> np.ndarray:
    index = parse_index_bytes(data, name)
    for array in (index.pts, index.dts, index.duration, index.size, index.offset):
        assert array.dtype == np.int64
    assert index.keyframe.dtype == bool
    return np.stack([index.pts, index.dts, index.size, index.offset, index.keyframe], axis=1)


@pytest.mark.parametrize("name", GOOD)
def test_index_equals_pyav_and_ffprobe(name):
    path = MEDIA / f"{name}.mp4"
    mine = index_table(path.read_bytes(), name)
    np.testing.assert_array_equal(mine, packet_table_pyav(path))
    np.testing.assert_array_equal(mine, packet_table_ffprobe(path))


@pytest.mark.parametrize("name", GOOD)
def test_durations_and_stream_facts(name):
    path = MEDIA / f"{name}.mp4"
    index = parse_index_bytes(path.read_bytes(), name)
    np.testing.assert_array_equal(np.diff(index.dts), index.duration[:-1])
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.time_base.denominator == index.timescale and stream.time_base.numerator == 1
        assert (stream.codec_context.width, stream.codec_context.height) == (index.width,
                                                                             index.height)
        assert stream.id == index.track_id
        assert stream.codec_context.codec_tag == index.codec


@pytest.mark.parametrize("name", BAD)
def test_malformed_files_raise_their_error(name):
    expected = getattr(errors, DESCRIPTIONS[name]["error"])
    with pytest.raises(expected) as info:
        parse_index_bytes((MEDIA / f"{name}.mp4").read_bytes(), f"{name}.mp4")
    assert f"{name}.mp4" in str(info.value)


def test_first_dts_negative_with_b_frames():
    index = parse_index_bytes((MEDIA / "h264_b.mp4").read_bytes(), "h264_b")
    assert index.dts[0] < 0 and index.pts.min() == 0


def test_open_gop_fixture_has_leading_pictures():
    index = parse_index_bytes((MEDIA / "h264_opengop.mp4").read_bytes(), "h264_opengop")
    keys = np.flatnonzero(index.keyframe)
    assert len(keys) > 1
    gop_ends = [*keys[1:], len(index)]
    leading = [k for k, end in zip(keys, gop_ends, strict=True)
               if index.pts[k:end].min() < index.pts[k]]
    assert leading, "no keyframe with leading pictures: the fixture is not open-GOP"


# --- reads ------------------------------------------------------------------------------------


class CountingReader:
    def __init__(self, data: bytes):
        self.data, self.reads = data, []

    def __call__(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return self.data[offset : offset + length]


def mdat_payloads(data: bytes) -> list[tuple[int, int]]:
    """[start, end) of every top-level mdat payload, by an independent walk."""
    out, pos = [], 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = len(data) - pos
        if kind == b"mdat":
            out.append((pos + header, pos + size))
        pos += size
    return out


@pytest.mark.parametrize("name, max_reads", [
    ("h264_b_faststart", 2), ("h264_b_size0", 2), ("h264_b", 3), ("h264_b_largesize", 3),
    ("h264_nob_uuid", 3), ("lerobot_av1", 3), ("h264_audio", 3),
])
def test_few_reads_and_no_payload(name, max_reads):
    data = (MEDIA / f"{name}.mp4").read_bytes()
    reader = CountingReader(data)
    parse_index(reader, len(data), name)
    assert len(reader.reads) <= max_reads
    for offset, length in reader.reads:
        for start, end in mdat_payloads(data):
            # only the first, fixed-size probe may reach into the payload
            overlap = min(end, offset + length) - max(start, offset)
            assert overlap <= 0 or (offset == 0 and length <= 4096), (offset, length, start, end)


def test_moov_at_end_of_large_file_reads_three_small_ranges():
    """A payload much larger than the first probe: reads are head, tail probe, rest of moov."""
    data = (MEDIA / "h264_b.mp4").read_bytes()
    payload = mdat_payloads(data)[0]
    filler = 10_000_000
    # enlarge mdat with unreferenced bytes at its end; moov follows, offsets unchanged
    grown = bytearray(data[: payload[1]]) + bytes(filler) + data[payload[1]:]
    mdat_at = payload[0] - 8
    struct.pack_into(">I", grown, mdat_at, struct.unpack_from(">I", data, mdat_at)[0] + filler)
    reader = CountingReader(bytes(grown))
    index = parse_index(reader, len(grown), "grown")
    assert len(reader.reads) <= 3
    assert sum(length for _, length in reader.reads) < 200_000
    np.testing.assert_array_equal(index.offset, parse_index_bytes(data, "h264_b").offset)


# --- box walking and table variants, each checked against ffprobe on the edited file -----------


def test_walk_boxes_sizes():
    uuid = struct.pack(">I4s", 8 + 16 + 2, b"uuid") + bytes(16) + b"hi"
    large = struct.pack(">I4sQ", 1, b"free", 16 + 3) + b"abc"
    to_end = struct.pack(">I4s", 0, b"mdat") + b"12345"
    data = b"xx" + uuid + large + to_end
    boxes = walk_boxes(data, 2, len(data), 100, "mem")
    assert [(b.type, b.offset, b.header_size, b.size) for b in boxes] == [
        ("uuid", 102, 24, 26), ("free", 128, 16, 19), ("mdat", 147, 8, 13)]


@pytest.mark.parametrize("data, words", [
    (struct.pack(">I4s", 40, b"moov") + bytes(10), ["moov", "offset 7", "runs past"]),
    (struct.pack(">I4s", 5, b"trak"), ["trak", "offset 7", "smaller than its"]),
    (struct.pack(">I4s", 1, b"mdat") + bytes(2), ["mdat", "offset 7", "64-bit"]),
    (b"\0\0\0", ["truncated box header", "offset 7"]),
])
def test_walk_boxes_reports_type_and_offset(data, words):
    with pytest.raises(errors.MalformedMp4) as info:
        walk_boxes(data, 0, len(data), 7, "mem.mp4")
    for word in [*words, "mem.mp4"]:
        assert word in str(info.value)


def find_box(data: bytes, path: list[str]) -> int:
    """Offset of the box at ``path`` (video trak), by a plain independent walk."""
    start, end, found = 0, len(data), None
    for kind in path:
        pos = start
        while pos < end:
            size, raw = struct.unpack_from(">I4s", data, pos)
            if raw.decode() == kind and (kind != "trak" or b"vide" in data[pos : pos + size]):
                found = pos
                break
            pos += size
        start, end = found + 8, found + struct.unpack_from(">I", data, found)[0]
    return found


STBL = ["moov", "trak", "mdia", "minf", "stbl"]


def check_edit_against_ffprobe(tmp_path, data: bytes, name: str) -> np.ndarray:
    path = tmp_path / f"{name}.mp4"
    path.write_bytes(data)
    mine = index_table(data, name)
    np.testing.assert_array_equal(mine, packet_table_ffprobe(path))
    np.testing.assert_array_equal(mine, packet_table_pyav(path))
    return mine


def test_ctts_v0_with_negative_offsets(tmp_path):
    data = bytearray((MEDIA / "h264_negcts.mp4").read_bytes())
    ctts = find_box(data, [*STBL, "ctts"])
    assert data[ctts + 8] == 1
    data[ctts + 8] = 0  # same values, declared unsigned: FFmpeg reads them signed anyway
    original = index_table((MEDIA / "h264_negcts.mp4").read_bytes(), "negcts")
    np.testing.assert_array_equal(check_edit_against_ffprobe(tmp_path, bytes(data), "v0"),
                                  original)


def test_stss_absent_means_all_keyframes():
    data = (MEDIA / "h264_intra.mp4").read_bytes()
    assert b"stss" not in data
    assert index_table(data, "h264_intra")[:, 4].all()


def test_stz2_16_bit_sizes(tmp_path):
    data = (MEDIA / "h264_b.mp4").read_bytes()  # moov at the end: resizing it moves no sample
    stsz = find_box(data, [*STBL, "stsz"])
    size, count = struct.unpack_from(">I", data, stsz)[0], struct.unpack_from(">I", data,
                                                                               stsz + 16)[0]
    sizes = struct.unpack_from(f">{count}I", data, stsz + 20)
    assert max(sizes) < 1 << 16
    stz2 = struct.pack(">I4sI3xBI", 20 + 2 * count, b"stz2", 0, 16, count)
    stz2 += struct.pack(f">{count}H", *sizes)
    delta = len(stz2) - size
    out = bytearray(data[:stsz] + stz2 + data[stsz + size:])
    for kind_path in (STBL[:i] for i in range(1, 6)):
        at = find_box(out, kind_path)
        struct.pack_into(">I", out, at, struct.unpack_from(">I", out, at)[0] + delta)
    mine = check_edit_against_ffprobe(tmp_path, bytes(out), "stz2")
    np.testing.assert_array_equal(mine, index_table(data, "h264_b"))


def test_unsupported_and_malformed_messages_name_the_box():
    data = bytearray((MEDIA / "h264_nob.mp4").read_bytes())
    stts = find_box(data, [*STBL, "stts"])
    struct.pack_into(">I", data, stts + 12, 1 << 30)  # entry_count far beyond the box
    with pytest.raises(errors.MalformedMp4, match=r"'stts' at offset \d+: entry_count"):
        parse_index_bytes(bytes(data), "x.mp4")


# --- conformance cases (expected values come from ffprobe, see make_conformance.py) ------------

CASES = sorted((MEDIA.parent / "mp4_index").glob("*.json"))


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_conformance_mp4_index(case):
    doc = json.loads(case.read_text())
    assert doc["kind"] == "mp4_index"
    media = {"file": str(MEDIA.parent / doc["input"]["file"])}  # relative to the fixtures
    if "error" in doc["expected"]:
        with pytest.raises(getattr(errors, doc["expected"]["error"])):
            kind_mp4_index(media)
    else:
        assert kind_mp4_index(media) == doc["expected"]


# --- edits that FFmpeg would apply by dropping or discarding samples are refused -------------


def ffprobe_discards_or_drops(path: Path, n: int) -> bool:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_packets", "-show_entries",
         "packet=flags", "-of", "json", str(path)], check=True, capture_output=True,
        text=True).stdout
    packets = json.loads(out)["packets"]
    return len(packets) != n or any("D" in p["flags"] for p in packets)


@pytest.mark.parametrize("field, value", [
    ("media_time", 2048),  # starts after the first frames: FFmpeg discards them
    ("segment_duration", 600),  # ends at half the track: FFmpeg drops the tail
])
def test_trimming_edits_are_refused(tmp_path, field, value):
    data = bytearray((MEDIA / "h264_b.mp4").read_bytes())
    elst = find_box(data, ["moov", "trak", "edts", "elst"])
    assert data[elst + 8] == 0  # version 0: (u32 duration, s32 media_time, rate)
    struct.pack_into(">I" if field == "segment_duration" else ">i", data,
                     elst + 16 + (0 if field == "segment_duration" else 4), value)
    path = tmp_path / "trimmed.mp4"
    path.write_bytes(data)
    n = len(parse_index_bytes((MEDIA / "h264_b.mp4").read_bytes(), "h264_b"))
    assert ffprobe_discards_or_drops(path, n)  # the oracle: FFmpeg no longer keeps every sample
    with pytest.raises(errors.UnsupportedMp4, match="edit list"):
        parse_index_bytes(bytes(data), "trimmed.mp4")


def test_inspect_json_carries_the_whole_sample_table(capsys):
    from refstream.tools.cli import main

    path = MEDIA / "h264_opengop.mp4"
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["samples"]
    table = np.stack([s["pts"], s["dts"], s["size"], s["offset"], s["keyframe"]], axis=1)
    np.testing.assert_array_equal(table, packet_table_ffprobe(path))
    assert s["timescale"] == 15360 and len(s["duration"]) == len(s["pts"])
    assert [b["type"] for b in report["boxes"] if b["depth"] == 0] == ["ftyp", "free", "mdat",
                                                                       "moov"]
    assert report["edit_list"]["media_time"] == 1024
    assert main(["inspect", str(path)]) == 0
    assert "video track 1: avc1 96x64" in capsys.readouterr().out


def test_top_level_moof_is_unsupported():
    ftyp = struct.pack(">I4s4sI", 16, b"ftyp", b"isom", 0)
    moof = struct.pack(">I4s", 16, b"moof") + bytes(8)
    with pytest.raises(errors.UnsupportedMp4, match=r"'moof' at offset 16"):
        parse_index_bytes(ftyp + moof, "frag.mp4")


def test_no_moov_is_malformed():
    data = struct.pack(">I4s4sI", 16, b"ftyp", b"isom", 0) + struct.pack(">I4s", 0, b"mdat")
    with pytest.raises(errors.MalformedMp4, match="no 'moov'"):
        parse_index_bytes(data + bytes(100), "nomoov.mp4")
