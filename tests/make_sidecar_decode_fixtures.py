"""Write the conformance cases of kinds ``frame_select`` (spec/fixtures/decode/) and
``sidecar_record`` (spec/fixtures/sidecar/) with expected values from oracles that share no code
with refstream: binary64 distances (plain Python floats) to every frame; and a record built by
hand from SPEC §10 — a scan of the storage types' integer ranges, the arrays packed with
``struct``, their SHA-256, the meta object and the record's name from ``hashlib``.
``python tests/make_sidecar_decode_fixtures.py`` rewrites them; the tests recompute every
expectation with the same oracles and compare."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures"

# (dtype, bits, signed, struct code) in the order the spec lists the storage types.
STORAGE_TYPES = [("|u1", 8, False, "B"), ("|i1", 8, True, "b"), ("<u2", 16, False, "H"),
                 ("<i2", 16, True, "h"), ("<u4", 32, False, "I"), ("<i4", 32, True, "i"),
                 ("<i8", 64, True, "q")]
FIELDS = ("dts", "pts", "duration", "size", "offset", "keyframe")


def oracle_frame_select(case: dict) -> dict:
    """Nearest frame over every frame by the binary64 distance |pts·num / den − t| of plain
    Python floats (one correctly rounded division, one subtraction); ties to the earlier pts."""
    num, den = case["time_base"]
    chosen = []
    for t in case["times_s"]:
        best = None
        for pts in sorted(case["pts"]):
            distance = abs(pts * num / den - t)
            if best is None or distance < best[0]:
                best = (distance, pts)
        if best is None or best[0] > case["tolerance_s"]:
            return {"error": "FrameNotFound"}
        chosen.append(best[1])
    return {"pts": chosen}


def storage(values: list, flags: bool) -> tuple[str | None, object]:
    """(dtype, None) for a stored array, (None, value) for a constant one (SPEC §10.2)."""
    if not values:
        return None, False if flags else 0
    if all(v == values[0] for v in values):
        return None, values[0]
    if flags:
        return "|b1", None
    for name, bits, signed, _ in STORAGE_TYPES:
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        if lo <= min(values) and max(values) <= hi:
            return name, None
    raise ValueError("values outside int64")


def oracle_sidecar_record(case: dict) -> dict:
    index = case["index"]
    identity = case.get("identity")
    if identity is None:
        identity = f"local:size={index['file_size']};mtime_ns={case['local_mtime_ns']}"
    count = len(index["dts"])
    codes = {name: code for name, _, _, code in STORAGE_TYPES} | {"|b1": "?"}
    fields, constants, data = [], {}, b""
    for name in FIELDS:
        dtype, value = storage(index[name], name == "keyframe")
        if dtype is None:
            constants[name] = value
        else:
            fields.append([name, dtype, [count]])
            data += struct.pack(f"<{count}{codes[dtype]}", *index[name])
    meta = {"schema": "refstream-index", "schema_version": 2, "identity": identity,
            "size": index["file_size"], "samples": count, "constants": constants,
            **{name: index[name] for name in ("ftyp", "stsd", "codec", "width", "height",
                                              "track_id", "timescale", "movie_timescale")}}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    assert identity != ESCAPED_IDENTITY or ESCAPED_IDENTITY_JSON.encode() in text
    name = hashlib.sha256(f"{index['file_size']} {identity}".encode()).hexdigest() + ".npy"
    head = [["sha256", "|u1", [32]], ["meta", "|u1", [len(text)]]]
    return {"identity": identity, "name": name, "fields": [*head, *fields], "meta": meta,
            "arrays_sha256": hashlib.sha256(data).hexdigest()}


def frame_select_cases() -> dict[str, tuple[str, dict]]:
    grid = [k * 512 for k in range(30)]  # 30 fps at timescale 15360, as PyAV writes
    bframes = [0, 1024, 512, 1536, 3072, 2048, 2560, 3584]  # decode order of a reordered GOP
    ntsc = [k * 3003 for k in range(10)]  # 29.97 fps at timescale 90000
    return {
        "exact-times": ("every request is a frame's exact time", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 1e-4,
            "times_s": [p / 15360 for p in (0, 512, 7168, 14848)]}),
        "repeated-unordered": ("requests repeat and come in any order", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 1e-4,
            "times_s": [p / 15360 for p in (9216, 512, 9216, 0, 512)]}),
        "pts-in-decode-order": ("frames listed in decode order (B-frames) select by pts", {
            "pts": bframes, "time_base": [1, 15360], "tolerance_s": 1e-4,
            "times_s": [p / 15360 for p in (512, 1024, 3072, 2048)]}),
        "nearest-within-tolerance": ("a time 0.3 frame late and one 0.3 early pick frame 12", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 0.4 / 30,
            "times_s": [12 / 30 + 0.3 / 30, 12 / 30 - 0.3 / 30]}),
        "tie-goes-to-earlier": ("a time exactly between two frames picks the earlier one", {
            "pts": [0, 512, 1024], "time_base": [1, 1024], "tolerance_s": 0.25,
            "times_s": [0.25, 0.75]}),
        "tolerance-is-inclusive": ("a distance equal to the tolerance is accepted", {
            "pts": [0, 1024], "time_base": [1, 1024], "tolerance_s": 0.125,
            "times_s": [0.125, 0.875]}),
        "just-outside-tolerance": ("a distance one ulp above the tolerance is an error", {
            "pts": [0, 1024], "time_base": [1, 1024], "tolerance_s": 0.12499999999999999,
            "times_s": [0.125]}),
        "between-frames": ("half a frame from both neighbours with a quarter-frame tolerance", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 0.25 / 30,
            "times_s": [0.0, 5.5 / 30]}),
        "after-the-last-frame": ("one frame past the last frame", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 1e-4,
            "times_s": [30 / 30]}),
        "before-the-first-frame": ("a negative local time", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 1e-4,
            "times_s": [-1 / 30]}),
        "binary64-distance": ("t - tol <= pts / timescale <= t + tol holds in binary64, but "
                              "the binary64 distance is 1.0000000002e-4 s > tol: unserved", {
            "pts": [194935, 194936, 194937], "time_base": [1, 30], "tolerance_s": 1e-4,
            "times_s": [6497.866766666667]}),
        "binary64-distance-rounds-down": ("t + tol < pts / timescale in binary64, but the "
                                          "binary64 distance rounds to tol: served", {
            "pts": [20, 40], "time_base": [1, 15360], "tolerance_s": 0.001,
            "times_s": [0.00030208333333333313]}),
        "zero-tolerance-exact-times": ("tolerance 0 serves times equal to pts / timescale", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 0.0,
            "times_s": [p / 15360 for p in (512, 0, 7168)]}),
        "zero-tolerance-one-ulp-off": ("tolerance 0: a time one ulp off a frame is unserved", {
            "pts": grid, "time_base": [1, 15360], "tolerance_s": 0.0,
            "times_s": [0.0, math.nextafter(512 / 15360, 1.0)]}),
        "ntsc-rate": ("29.97 fps: times k·1001/30000 computed in binary64", {
            "pts": ntsc, "time_base": [1, 90000], "tolerance_s": 1e-4,
            "times_s": [k * 1001 / 30000 for k in (0, 3, 9, 4)]}),
    }


def record_input(count: int, **arrays) -> dict:
    """A record case's index: ``count`` samples of a small H.264 file, ``arrays`` replaced."""
    index = {"file_size": 90_000, "ftyp": "0000001c667479706973366f6d", "stsd": "00000001abcd",
             "codec": "avc1", "width": 64, "height": 48, "track_id": 1, "timescale": 15360,
             "movie_timescale": 1000, "dts": [512 * k for k in range(count)],
             "pts": [512 * k for k in range(count)], "duration": [512] * count,
             "size": [100 + k for k in range(count)],
             "offset": [48 + sum(100 + j for j in range(k)) for k in range(count)],
             "keyframe": [k % 10 == 0 for k in range(count)]}
    return index | arrays


SHA = "sha256:" + "7c" * 32
# An identity whose characters each take another escape in the meta (SPEC §10.2), and the
# meta's text of it written out by hand: the oracle's serialiser must agree.
ESCAPED_IDENTITY = 'etag:"\x01\t\x7f\u00e9\U0001F600"'
ESCAPED_IDENTITY_JSON = '"etag:\\"\\u0001\\t\\u007f\\u00e9\\ud83d\\ude00\\""'


def sidecar_record_cases() -> dict[str, tuple[str, dict]]:
    gop = {"dts": [-1024, -512, 0, 512, 1024, 1536], "pts": [0, 1536, 512, 1024, 3072, 2048],
           "size": [3000, 200, 150, 140, 2100, 160], "keyframe": [True, False, False, False,
                                                                 True, False]}
    gop["offset"] = [48 + sum(gop["size"][:k]) for k in range(6)]
    return {
        "b-frames": ("a reordered GOP: narrow dts/pts/size/offset, constant duration", {
            "identity": SHA, "index": record_input(6, **gop)}),
        "av1-g2": ("pts = dts, keyframes every other sample", {
            "identity": SHA, "index": record_input(8, codec="av01", keyframe=[
                k % 2 == 0 for k in range(8)])}),
        "empty": ("no samples: every array is a constant, 0 or false", {
            "identity": SHA, "index": record_input(0)}),
        "one-sample": ("one sample: every array is a constant", {
            "identity": SHA, "index": record_input(1)}),
        "local-identity": ("a local file: size and mtime in nanoseconds", {
            "local_mtime_ns": "1700000000123456789", "index": record_input(4)}),
        "etag-identity": ("an HTTP strong ETag, quotes included", {
            "identity": 'etag:"5f2b-61a3c0de"', "index": record_input(4)}),
        "git-blob-identity": ("a Hub file outside LFS: its git blob id", {
            "identity": "git-sha1:9e26dfeeb6e641a33dae4961196235bdb965b21b",
            "index": record_input(4)}),
        "u1-and-i1-bounds": ("0..255 fits u1, -128..127 fits i1", {
            "identity": SHA, "index": record_input(3, dts=[0, 255, 17], pts=[-128, 127, 0])}),
        "just-past-u1-and-i1": ("256 needs u2, -129 needs i2", {
            "identity": SHA, "index": record_input(3, dts=[0, 256, 1], pts=[-129, 0, 1])}),
        "u2-before-i2": ("0..40000 is u2 (unsigned first); -32768..32767 fits i2", {
            "identity": SHA, "index": record_input(3, size=[0, 40000, 2],
                                                   pts=[-32768, 32767, 0])}),
        "u4-and-i4": ("65536 needs u4, -40000..1 needs i4", {
            "identity": SHA, "index": record_input(3, size=[3, 65536, 4],
                                                   pts=[-40000, 1, 0])}),
        "u4-top": ("2^32-1 still fits u4", {
            "identity": SHA, "index": record_input(3, offset=[0, 4294967295, 1])}),
        "i8-offsets": ("file offsets past 4 GiB need i8", {
            "identity": SHA, "index": record_input(3, offset=[8, 4294967296, 9])}),
        "i8-negative-wide": ("-1 and 2^31 need i8", {
            "identity": SHA, "index": record_input(3, dts=[-1, 2147483648, 0])}),
        "negative-constant": ("a negative constant is stored once", {
            "identity": SHA, "index": record_input(3, duration=[-1024] * 3)}),
        "all-keyframes": ("all keyframes: a constant true", {
            "identity": SHA, "index": record_input(3, keyframe=[True] * 3)}),
        "mixed-keyframes": ("mixed keyframe flags are stored as bytes", {
            "identity": SHA, "index": record_input(3, keyframe=[True, False, False])}),
        "identity-escapes": ("an identity with a control character, a tab, DEL, a non-ASCII and "
                             "an astral character: the meta escapes each (\\u0001 \\t \\u007f "
                             "\\u00e9 \\ud83d\\ude00), which sets its length", {
            "identity": ESCAPED_IDENTITY, "index": record_input(4)}),
    }


def write() -> None:
    for area, kind, cases, oracle in (
        ("decode", "frame_select", frame_select_cases(), oracle_frame_select),
        ("sidecar", "sidecar_record", sidecar_record_cases(), oracle_sidecar_record),
    ):
        folder = FIXTURES / area
        folder.mkdir(parents=True, exist_ok=True)
        for name, (description, case_input) in cases.items():
            document = {"kind": kind, "description": description, "input": case_input,
                        "expected": oracle(case_input)}
            (folder / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    write()
