"""``refstream inspect FILE``: one MP4's box tree, video track, edit list, GOPs and sample
table, as the index (``refstream.mp4``) sees them."""

from __future__ import annotations

import numpy as np

from refstream import mp4

# Boxes whose payload is a sequence of child boxes.
CONTAINERS = frozenset({"moov", "trak", "mdia", "minf", "stbl", "edts", "dinf", "mvex", "udta"})
TRACK_FIELDS = ("track_id", "codec", "width", "height", "timescale", "movie_timescale")
SAMPLE_FIELDS = ("pts", "dts", "duration", "size", "offset", "keyframe")  # decode order


def box_tree(read_range: mp4.ReadRange, file_size: int, path: str, moov: mp4.Box,
             moov_bytes: bytes) -> list[tuple[int, mp4.Box]]:
    """(depth, box) for every top-level box and every box inside ``moov``, in file order."""
    out: list[tuple[int, mp4.Box]] = []
    pos = 0
    while pos < file_size:
        head = read_range(pos, min(32, file_size - pos))
        box = mp4.read_box(head, 0, len(head), pos, file_size, path)
        out.append((0, box))
        if box.type == "moov":
            out.extend(_subtree(moov_bytes, moov, path, 1))
        pos = box.end
    return out


def _subtree(data: bytes, parent: mp4.Box, path: str, depth: int) -> list[tuple[int, mp4.Box]]:
    out = []
    start = parent.payload_offset - parent.offset + (8 if parent.type == "stsd" else 0)
    for box in mp4.walk_boxes(data, start, parent.size, parent.offset, path):
        out.append((depth, box))
        if box.type in CONTAINERS or box.type == "stsd":
            sub = data[box.offset - parent.offset : box.end - parent.offset]
            out.extend(_subtree(sub, box, path, depth + 1))
    return out


def describe(read_range: mp4.ReadRange, file_size: int, path: str) -> dict:
    """The JSON-ready report of one file; its sample table holds every sample in decode order
    (ticks of ``timescale``), and each GOP is a keyframe and the samples up to the next one."""
    moov, moov_bytes, ftyp = mp4.locate_moov(read_range, file_size, path)
    tree = box_tree(read_range, file_size, path, moov, moov_bytes)
    index = mp4.parse_moov(moov_bytes, moov, file_size, ftyp, path)
    edits = mp4.video_edit_list(moov_bytes, moov, path)
    keys = np.flatnonzero(index.keyframe)
    ends = np.append(keys[1:], len(index))
    return {
        "path": path, "file_size": file_size,
        "boxes": [{"depth": d, "type": b.type, "offset": b.offset, "size": b.size}
                  for d, b in tree],
        "track": {**{name: getattr(index, name) for name in TRACK_FIELDS},
                  "samples": len(index), "payload_bytes": int(index.size.sum())},
        "edit_list": None if edits is None else {
            "empty_duration": edits.empty_duration, "media_duration": edits.media_duration,
            "media_time": edits.media_time},
        "gops": [{"keyframe": int(k), "samples": int(e - k),
                  "first_pts": int(index.pts[k:e].min()), "keyframe_pts": int(index.pts[k])}
                 for k, e in zip(keys, ends, strict=False)],
        "samples": {"timescale": index.timescale,
                    **{name: getattr(index, name).tolist() for name in SAMPLE_FIELDS}},
    }
