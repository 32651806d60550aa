"""Write the conformance cases of kinds ``frame_select`` (spec/fixtures/decode/) and
``sidecar_storage`` (spec/fixtures/sidecar/) with expected values from brute-force oracles that
share no code with refstream: binary64 distances (plain Python floats) to every frame, and a scan
of the integer ranges of the storage types. ``python tests/make_sidecar_decode_fixtures.py``
rewrites them; the tests recompute every expectation with the same oracles and compare."""

from __future__ import annotations

import json
import math
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures"

# (dtype string, bits, signed) in the order the spec lists the storage types, spelled as the
# compact file's header spells them (byte order "<" little-endian, "|" not applicable).
STORAGE_TYPES = [("|u1", 8, False), ("|i1", 8, True), ("<u2", 16, False), ("<i2", 16, True),
                 ("<u4", 32, False), ("<i4", 32, True), ("<i8", 64, True)]


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


def oracle_sidecar_storage(case: dict) -> dict:
    values = case["values"]
    flags = case.get("flags", False) or (values and all(isinstance(v, bool) for v in values))
    if not values:
        return {"value": False if flags else 0}
    if all(v == values[0] for v in values):
        return {"value": values[0]}
    if flags:
        return {"dtype": "|b1"}
    low, high = min(values), max(values)
    for name, bits, signed in STORAGE_TYPES:
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        if lo <= low and high <= hi:
            return {"dtype": name}
    raise ValueError("values outside int64")


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


def sidecar_storage_cases() -> dict[str, tuple[str, dict]]:
    return {
        "empty": ("an empty array is a constant 0", {"values": []}),
        "empty-flags": ("an empty flag array is a constant false", {"values": [], "flags": True}),
        "constant": ("a constant array is stored once", {"values": [512, 512, 512]}),
        "constant-negative": ("negative constants too", {"values": [-1024, -1024]}),
        "u1-bounds": ("0..255 fits u1", {"values": [0, 255, 17]}),
        "u2-just-past-u1": ("256 needs u2", {"values": [0, 256]}),
        "i1-bounds": ("-128..127 fits i1", {"values": [-128, 127]}),
        "i2-just-past-i1": ("-129 needs i2", {"values": [-129, 0]}),
        "u2-before-i2": ("0..40000 is u2 (unsigned types are tried first)", {"values": [0, 40000]}),
        "i2-negative": ("-32768..32767 fits i2", {"values": [-32768, 32767]}),
        "u4": ("65536 needs u4", {"values": [3, 65536]}),
        "i4": ("-40000..1 needs i4", {"values": [-40000, 1]}),
        "u4-top": ("2^32-1 still fits u4", {"values": [0, 4294967295]}),
        "i8-offsets": ("file offsets past 4 GiB need i8", {"values": [8, 4294967296]}),
        "i8-negative-wide": ("-1 and 2^31 need i8", {"values": [-1, 2147483648]}),
        "flags": ("mixed keyframe flags are stored as bytes", {"values": [True, False, False]}),
        "flags-constant": ("all keyframes: a constant true", {"values": [True, True]}),
    }


def write() -> None:
    for area, kind, cases, oracle in (
        ("decode", "frame_select", frame_select_cases(), oracle_frame_select),
        ("sidecar", "sidecar_storage", sidecar_storage_cases(), oracle_sidecar_storage),
    ):
        folder = FIXTURES / area
        folder.mkdir(parents=True, exist_ok=True)
        for name, (description, case_input) in cases.items():
            document = {"kind": kind, "description": description, "input": case_input,
                        "expected": oracle(case_input)}
            (folder / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    write()
