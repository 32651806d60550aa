"""Run the golden fixtures in ``spec/fixtures`` against an implementation.

A *case* is one JSON file ``spec/fixtures/<area>/<name>.json``::

    {"kind": "<kind>", "description": "...", "input": {...}, "expected": {...}}

An *implementation* is a command. For each case the runner starts it, writes
``{"kind": ..., "input": ...}`` as JSON to its standard input and reads one JSON object, the
answer, from its standard output. The answer passes when it equals ``expected`` exactly (JSON
values; numbers compare by value, so ``1`` equals ``1.0``). An expected error is written
``{"error": "<ClassName>"}`` with a class name from ``refstream.errors``; an implementation in
another language answers with the same name.

refstream's own adapter (``python -m refstream.conformance``) is the default implementation; with
no ``--impl`` the runner calls the same adapter functions in-process, through the same JSON
round trip, which is much faster than one interpreter per case.

Usage::

    refstream conformance                      # refstream itself
    refstream conformance --impl "./my-impl"   # any command speaking the protocol
    refstream conformance --kind plan          # only cases of one kind

The runner prints one line per failing case with the first difference and ends with
``N passed, N failed``.
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from refstream.errors import RefstreamError

# The fixtures shipped with refstream: <repo>/spec/fixtures.
FIXTURES_DIR = Path(__file__).resolve().parent.parent / "spec" / "fixtures"

# kind -> "module:function"; each function maps a case's input dict to an answer dict.
ADAPTERS: dict[str, str] = {
    "rng": "refstream.rng:conformance_rng",
    "shard": "refstream.shard:conformance_shard",
    "limits": "refstream.shard:conformance_limits",
    "plan": "refstream.planner:conformance_plan",
    "batches_per_worker": "refstream.planner:conformance_batches_per_worker",
    "resume": "refstream.planner:conformance_resume",
    "epoch_batches": "refstream.planner:conformance_epoch_batches",
    "resume_state": "refstream.planner:conformance_resume_state",
    "meta": "refstream.meta:conformance_meta",
    "windows": "refstream.windows:conformance_windows",
    "range_response": "refstream.fetch:conformance_range_response",
    "suffix_response": "refstream.fetch:conformance_suffix_response",
    "hf_url": "refstream.fetch:conformance_hf_url",
    "row_group_candidates": "refstream.tables:conformance_row_group_candidates",
    "budget_ops": "refstream.budget:conformance_budget_ops",
    "frame_select": "refstream.decode:conformance_frame_select",
    "sidecar_storage": "refstream.sidecar:conformance_sidecar_storage",
    "mp4_index": "refstream.conformance:conformance_mp4_index",
    "span": "refstream.conformance:conformance_span",
    "synth": "refstream.conformance:conformance_synth",
    "doctor_tiling": "refstream.doctor:conformance_doctor_tiling",
    "doctor_requests": "refstream.doctor:conformance_doctor_requests",
}

# A case that makes an implementation run longer than this fails instead of hanging the runner.
CASE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    path: Path
    kind: str
    input: dict
    expected: dict


@dataclass(frozen=True)
class Outcome:
    case: Case
    difference: str | None  # None when the answer equals the expectation


def load_cases(root: Path = FIXTURES_DIR, kind: str | None = None) -> list[Case]:
    """Every case under ``root`` (sorted by path), optionally only those of one kind."""
    cases = []
    for path in sorted(root.rglob("*.json")):
        document = json.loads(path.read_text())
        if not isinstance(document, dict) or "kind" not in document:
            continue  # descriptions of media files and other JSON live beside the cases
        if kind is None or document["kind"] == kind:
            cases.append(Case(path, document["kind"], document["input"], document["expected"]))
    return cases


def answer(kind: str, case_input: dict) -> dict:
    """refstream's own answer to one case; refstream errors become ``{"error": name}``."""
    if kind not in ADAPTERS:
        return {"error": f"unknown kind {kind!r}"}
    module_name, function_name = ADAPTERS[kind].split(":")
    adapter = getattr(importlib.import_module(module_name), function_name)
    try:
        return adapter(case_input)
    except RefstreamError as exc:
        return {"error": type(exc).__name__}


def first_difference(expected, actual, where: str = "") -> str | None:
    """A description of the first place where two JSON values differ, or None if equal."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{where}.{key}: missing"
            if key not in expected:
                return f"{where}.{key}: unexpected key"
            found = first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(e, a, f"{where}[{i}]")
            if found:
                return found
        if len(expected) != len(actual):
            return f"{where}: expected {len(expected)} items, got {len(actual)}"
        return None
    same_type = isinstance(expected, bool) == isinstance(actual, bool)
    if same_type and expected == actual:
        return None
    return f"{where or '.'}: expected {_short(expected)}, got {_short(actual)}"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def in_process(case: Case) -> dict:
    """Ask refstream's own adapter, through the same JSON round trip as the protocol."""
    return json.loads(json.dumps(answer(case.kind, json.loads(json.dumps(case.input)))))


def via_command(command: str, fixtures: Path = FIXTURES_DIR) -> Callable[[Case], dict]:
    """Ask an implementation command, one process per case, run inside ``fixtures``."""
    argv = shlex.split(command)

    def ask(case: Case) -> dict:
        request = json.dumps({"kind": case.kind, "input": case.input})
        try:
            done = subprocess.run(
                argv,
                input=request,
                capture_output=True,
                text=True,
                timeout=CASE_TIMEOUT_S,
                cwd=fixtures,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CASE_TIMEOUT_S} s"}
        if done.returncode != 0:
            return {"error": f"exit status {done.returncode}: {done.stderr.strip()[-200:]}"}
        try:
            return json.loads(done.stdout)
        except json.JSONDecodeError:
            return {"error": f"not JSON: {_short(done.stdout)}"}

    return ask


def run(cases: list[Case], ask: Callable[[Case], dict]) -> Iterator[Outcome]:
    for case in cases:
        yield Outcome(case, first_difference(case.expected, ask(case)))


# --- adapters for the kinds that read media -----------------------------------------------
# The MP4 core (mp4.py, synth.py) never touches the file system; these adapters read the media
# file a case names, relative to the working directory (the protocol runs implementations inside
# the fixtures folder), else to the fixtures shipped with refstream.


def media_path(relpath: str) -> Path:
    here = Path(relpath)
    return here if here.exists() else FIXTURES_DIR / relpath


def _media_index(case_input: dict):
    from refstream.mp4 import parse_index_bytes

    return parse_index_bytes(media_path(case_input["file"]).read_bytes(), case_input["file"])


def conformance_mp4_index(case_input: dict) -> dict:
    """Kind ``mp4_index``: ``{file}`` → the index arrays in decode order."""
    index = _media_index(case_input)
    return {
        "codec": index.codec, "width": index.width, "height": index.height,
        "track_id": index.track_id, "timescale": index.timescale,
        "pts": index.pts.tolist(), "dts": index.dts.tolist(),
        "duration": index.duration.tolist(), "size": index.size.tolist(),
        "offset": index.offset.tolist(), "keyframe": index.keyframe.tolist(),
    }  # fmt: skip


def conformance_span(case_input: dict) -> dict:
    """Kind ``span``: ``{file, from_s, to_s, tolerance_s[, request_times_s]}`` → the span."""
    import numpy as np

    from refstream.synth import select_span

    index = _media_index(case_input)
    times = case_input.get("request_times_s")
    request_times_s = None if times is None else np.asarray(times, float)
    span = select_span(index, case_input["from_s"], case_input["to_s"],
                       case_input["tolerance_s"], request_times_s)  # fmt: skip
    return {"sample_lo": span.sample_lo, "sample_hi": span.sample_hi,
            "byte_offset": span.byte_offset, "byte_length": span.byte_length,
            "start_pts": span.start_pts}  # fmt: skip


def conformance_synth(case_input: dict) -> dict:
    """Kind ``synth``: ``{file, sample_lo, sample_hi}`` → synthesized size and SHA-256."""
    import hashlib

    from refstream.synth import Span, synthesize, synthesized_size

    index = _media_index(case_input)
    lo, hi = case_input["sample_lo"], case_input["sample_hi"]
    begin = int(index.offset[lo : hi + 1].min())
    end = int((index.offset[lo : hi + 1] + index.size[lo : hi + 1]).max())
    span = Span(lo, hi, begin, end - begin, int(index.pts[lo]))
    with open(media_path(case_input["file"]), "rb") as f:
        f.seek(begin)
        data = synthesize(index, span, f.read(end - begin))
    return {"synthesized_size": synthesized_size(index, span), "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def main_adapter() -> int:
    """The protocol end of refstream's adapter: one case on stdin, one answer on stdout."""
    request = json.load(sys.stdin)
    json.dump(answer(request["kind"], request["input"]), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main_adapter())
