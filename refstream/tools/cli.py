"""The ``refstream`` command line.

Each sub-command is a pair ``add_<name>(subparsers)`` / ``run_<name>(args) -> int`` below; the
work itself lives in the module that owns it, so this file only parses arguments and prints.
A refstream error is one line naming what to change (``-v`` adds the traceback), also when it
was raised inside a DataLoader worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from refstream import __version__, planner, rng, shard
from refstream.errors import RefstreamError, UsageError

if TYPE_CHECKING:
    from refstream.sidecar import VideoIndex

ROOT_HELP = "dataset root: a folder, an http(s):// base URL or hf://datasets/OWNER/NAME[@REV]"


def _print_summary(summary: dict, as_json: bool) -> None:
    """A command's summary: one JSON object, or one ``key: value`` line per entry."""
    print(json.dumps(summary) if as_json else "\n".join(f"{k}: {v}" for k, v in summary.items()))


def _episode_ids(text: str | None) -> list[int] | None:
    """``--episodes 3,7,9`` as a list of ids; None (all episodes) when not given."""
    if not text:
        return None
    try:
        return [int(e) for e in text.split(",") if e.strip()]
    except ValueError as exc:
        raise UsageError(f"--episodes: {exc}") from exc


class _Formatter(argparse.HelpFormatter):
    """Help that shows each option's default, unless it has none (None) or is a switch."""

    def _format_action(self, action: argparse.Action) -> str:
        if callable(action.help):  # worked out only when help is shown
            action.help = action.help()
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += " (default: %(default)s)"
        return text


VERBOSE_HELP = "on an error, show its traceback too"
# -v after the sub-command; SUPPRESS keeps the value given before it.
_COMMON = argparse.ArgumentParser(add_help=False)
_COMMON.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                     help=VERBOSE_HELP)
NUM_WORKERS = 2  # DataLoader workers of demo, stream and plan

_JSON = argparse.ArgumentParser(add_help=False)
_JSON.add_argument("--json", action="store_true", help="print the result as JSON")
_ROOT = argparse.ArgumentParser(add_help=False)
_ROOT.add_argument("root", help=ROOT_HELP)

# The DataLoader of demo and stream.
_LOADER = argparse.ArgumentParser(add_help=False)
_LOADER.add_argument("--num-workers", type=int, default=NUM_WORKERS, help="DataLoader workers")
_LOADER.add_argument("--batch-size", type=int, default=8, help="DataLoader batch size")
_LOADER.add_argument("--no-progress", action="store_true", help="no progress bar")

# The dataset and its order, as stream and plan take them (StreamingDataset's argument names).
_ORDER = argparse.ArgumentParser(add_help=False, parents=[_ROOT])
_ORDER.add_argument("--episodes", help="comma-separated episode ids (default: every episode)")
_ORDER.add_argument("--seed", type=int, help="order seed (default: 42)")
_ORDER.add_argument("--strategy", dest="sampling_strategy", default="pool",
                    choices=planner.STRATEGIES, help="how a worker mixes its resident episodes")
_ORDER.add_argument("--pool-size", dest="episode_pool_size", type=int, metavar="N", help="resident "
                    "episodes per worker (default: 32 per rank, split over the workers)")
_ORDER.add_argument("--pool-ramp", dest="episode_pool_ramp", type=int, metavar="K",
                    default=planner.DEFAULT_POOL_RAMP, help="the pool gains an episode every K "
                    "anchors until it is full (0: full from the start)")


def _command(subparsers, name: str, help_text: str, run: Callable[[argparse.Namespace], int],
             parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """A sub-command's parser, run by ``run``: its options' defaults in its help, ``-v``, and
    its own usage when an option is wrong."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   formatter_class=_Formatter, parents=[_COMMON, *parents])
    parser.set_defaults(parser=parser, run=run, passthrough=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refstream", description="Stream LeRobot v3 datasets (a folder, an http(s):// URL "
        "or hf://datasets/OWNER/NAME) into PyTorch, episode by episode.")
    parser.add_argument("--version", action="version", version=f"refstream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown and not args.passthrough:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    try:
        return args.run(args)
    except RefstreamError as exc:
        if args.verbose:
            traceback.print_exc()
            if exc.worker_traceback:
                print(f"in the DataLoader worker:\n{exc.worker_traceback}", file=sys.stderr)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(f"refstream {args.command}: {type(exc).__name__}: {first_line}", file=sys.stderr)
        return 2


def add_conformance(subparsers) -> None:
    p = _command(subparsers, "conformance", "run the spec fixtures against an implementation "
                 "(spec/run.py, the same runner)", run_conformance)
    p.add_argument("--impl", help="implementation command, run once per case inside the fixtures "
                   "folder (default: refstream itself, in-process)")
    p.add_argument("--fixtures", help="the spec/fixtures folder of refstream's source, spec/run.py "
                   "beside it (needed when refstream is installed: the package has no fixtures)")
    p.add_argument("--kind", action="append", default=[], help="only KIND cases (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="PATTERN",
                   help="only this case: its path under the fixtures folder, with or without "
                   ".json, or a pattern such as 'meta/valid-*' (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once")


def run_conformance(args) -> int:
    from refstream.tools import conformance

    root = conformance.fixtures_folder(args.fixtures)
    runner = conformance.load_runner(root)
    cases = runner.load_cases(root, args.kind, args.case)
    if not cases:
        wanted = [*(f"of kind {k!r}" for k in args.kind), *(f"named {c!r}" for c in args.case)]
        raise UsageError(f"no case {' or '.join(wanted)} in {root}")
    ask = runner.via_command(args.impl, root) if args.impl else conformance.in_process
    return runner.report(cases, ask, args.jobs)


def add_demo(subparsers) -> None:
    p = _command(subparsers, "demo", "write a small AV1 dataset, serve it on loopback HTTP, "
                 "stream one epoch and verify every frame", run_demo, [_LOADER])
    p.add_argument("--keep", dest="workdir", metavar="DIR", help="write the dataset into DIR and "
                   "keep it (default: a temporary folder, removed at the end)")


def run_demo(args) -> int:
    from refstream.tools.demo import run_demo as demo

    print("refstream demo: writing the dataset, serving it on 127.0.0.1, streaming one epoch")
    report = demo(args.workdir, num_workers=args.num_workers, batch_size=args.batch_size,
                  progress=not args.no_progress)
    print("\n".join(report.lines()))
    return 0 if not report.problems else 1



def add_stream(subparsers) -> None:
    p = _command(subparsers, "stream", "stream a dataset through a DataLoader and measure it",
                 run_stream, [_ORDER, _LOADER, _JSON])
    p.add_argument("--epochs", type=int, default=1, help="epochs to stream")
    p.add_argument("--max-samples", type=int, help="stop after exactly this many samples")
    p.add_argument("--delta-timestamps", metavar="JSON",
                   help='windows in seconds, e.g. \'{"action": [0, 0.0333]}\'')
    p.add_argument("--prefetch-episodes", type=int, default=8,
                   help="episodes fetched ahead per worker")
    p.add_argument("--byte-budget-gb", type=float, default=8.0,
                   help="GiB of video held per rank, split over the workers")
    p.add_argument("--decode-threads", type=int, default=None,
                   help="decode threads per worker (default: the CPUs shared among the workers, "
                        "1 or 2 each)")
    p.add_argument("--tolerance-s", type=float, default=1e-4,
                   help="how far a video frame may be from a requested time")
    p.add_argument("--uint8", dest="return_uint8", action="store_true",
                   help="camera frames as uint8 (C, H, W) instead of LeRobot's float32 in [0, 1]")
    p.add_argument("--batched", action="store_true",
                   help="each worker yields ready batches (the fastest path)")


# The stream options that are StreamingDataset arguments of the same name.
STREAM_OPTIONS = ("seed", "sampling_strategy", "episode_pool_size", "episode_pool_ramp",
                  "prefetch_episodes", "byte_budget_gb", "decode_threads", "tolerance_s",
                  "return_uint8", "batched")


def run_stream(args) -> int:
    from refstream.stream import StreamingDataset
    from refstream.tools.demo import consume

    episodes = _episode_ids(args.episodes)
    try:
        windows = json.loads(args.delta_timestamps) if args.delta_timestamps else None
    except ValueError as exc:
        raise UsageError(f"--delta-timestamps: {exc}") from exc
    options = {name: getattr(args, name) for name in STREAM_OPTIONS}
    dataset = StreamingDataset(args.root, episodes=episodes, delta_timestamps=windows,
                               batch_size=args.batch_size, num_workers=args.num_workers, **options)
    m = consume(dataset, num_workers=args.num_workers, batch_size=args.batch_size,
                epochs=args.epochs, max_samples=args.max_samples, progress=not args.no_progress)
    summary = {"root": args.root, "episodes": dataset.num_episodes, "frames": dataset.num_frames,
               "batched": args.batched, "samples": m.samples, "batches": m.batches,
               "seconds": round(m.seconds, 3), "samples_per_s": round(m.samples_per_s, 1),
               "first_sample_s": round(m.first_sample_s, 3)}
    _print_summary(summary, args.json)
    return 0



def add_plan(subparsers) -> None:
    p = _command(subparsers, "plan", "print a dataset's shard balance and anchor order",
                 run_plan, [_ORDER, _JSON])
    p.add_argument("--world-size", type=int, default=1, help="distributed ranks")
    p.add_argument("--rank", type=int, default=0, help="the rank whose workers are shown")
    p.add_argument("--num-workers", type=int, default=NUM_WORKERS,
                   help="DataLoader workers per rank")
    p.add_argument("--epoch", type=int, default=0, help="the epoch planned")
    p.add_argument("--limit", type=int, default=20, help="anchors shown per worker, 0 for all")


def run_plan(args) -> int:
    from refstream.meta import load_meta, select_episodes
    from refstream.roots import open_source

    chosen = _episode_ids(args.episodes)
    if args.limit < 0:
        raise UsageError(f"--limit must be 0 (all) or positive, got {args.limit}")
    with contextlib.closing(open_source(args.root)) as source:
        meta = load_meta(source)
    ids = select_episodes(meta, chosen)
    s = _plan_summary(args, ids, [meta.frames(e) for e in ids])
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{args.root}: {s['episodes']} episodes, {s['frames']} frames; world size "
          f"{s['world_size']}, rank {s['rank']}, {s['num_workers']} worker(s), seed {s['seed']}, "
          f"epoch {s['epoch']}, {s['strategy']}, pool {s['pool_size']} per worker")
    spread = max(s["rank_frames"]) - min(s["rank_frames"])
    print(f"frames per rank: {s['rank_frames']} (spread {spread}, longest episode "
          f"{s['longest_episode']})")
    print(f"frames per worker of rank {s['rank']}: {s['worker_frames']}")
    for w in s["workers"]:
        shown = " ".join(f"{e}:{f}" for e, f in w["anchors"])
        print(f"worker {w['worker']} ({len(w['episodes'])} episodes, {w['frames']} frames), "
              f"first {len(w['anchors'])} anchors (episode:frame): {shown}")
    return 0


def _plan_summary(args, episodes: list[int], frames: list[int]) -> dict:
    """The shard balance of every rank, the worker shares of ``--rank`` and each worker's first
    ``--limit`` anchors (0 = all) as a JSON-ready dict; no byte budget (sizes need the index)."""
    count = dict(zip(episodes, frames, strict=True))
    rank_frames = [sum(count[e] for e in part)
                   for part in shard.lpt_partition(episodes, frames, args.world_size)]
    empty = [str(r) for r, total in enumerate(rank_frames) if not total]
    if empty:  # said before the plan of this rank, which may fail for its own reasons
        print(f"refstream plan: warning: rank(s) {', '.join(empty)} of world size "
              f"{args.world_size} own no frames, and StreamingDataset raises ShardingError "
              f"there; use a world size of at most {sum(f > 0 for f in frames)}", file=sys.stderr)
    share = shard.rank_share(episodes, frames, args.rank, args.world_size)
    parts = shard.worker_shares(share, [count[e] for e in share], args.num_workers)
    limits = shard.split_limits(args.num_workers, pool_size=args.episode_pool_size,
                                byte_budget=None, decoder_cache=None, cameras=0)
    seed = rng.resolve_seed(args.seed)
    workers = []
    for worker, part in enumerate(parts):
        plan = planner.Planner(part, [count[e] for e in part], seed=seed, epoch=args.epoch,
                               rank=args.rank, worker=worker, strategy=args.sampling_strategy,
                               pool_size=limits.pool_size, pool_ramp=args.episode_pool_ramp)
        take = plan.remaining if args.limit == 0 else min(args.limit, plan.remaining)
        anchors = [list(next(plan)) for _ in range(take)]
        workers.append({"worker": worker, "episodes": part, "frames": sum(count[e] for e in part),
                        "anchors": anchors})
    return {"episodes": len(episodes), "frames": sum(frames), "world_size": args.world_size,
            "rank": args.rank, "num_workers": args.num_workers, "seed": seed, "epoch": args.epoch,
            "strategy": args.sampling_strategy, "pool_size": limits.pool_size,
            "pool_ramp": args.episode_pool_ramp,
            "longest_episode": max(frames, default=0), "rank_frames": rank_frames,
            "worker_frames": [w["frames"] for w in workers], "workers": workers}


def add_index(subparsers) -> None:
    p = _command(subparsers, "index", "build or refresh the video index of a dataset", run_index,
                 [_ROOT, _JSON])
    p.add_argument("--output", help="also write the publishable index here; a maintainer "
                   "uploads it to the dataset as meta/refstream-index.npz")
    p.add_argument("--workers", type=int, default=8, help="files indexed in parallel")


def run_index(args) -> int:
    from refstream import sidecar
    from refstream.meta import load_meta
    from refstream.roots import open_source

    started = time.monotonic()
    with contextlib.closing(open_source(args.root)) as source:
        index = sidecar.ensure_index(source, load_meta(source).video_files(),
                                     workers=args.workers, progress=draw_index_progress)
    seconds = time.monotonic() - started
    records = {record.path: record for record in index.records.values()}
    # One record mapped at a time: mapping them all would hold their pages.
    samples = sum(len(sidecar.read_record(path, record.size, record.identity))
                  for path, record in records.items())
    summary = {"root": args.root, "origin": index.origin, "files": len(index.records),
               "indexed": index.indexed, "samples": samples,
               "video_bytes": sum(record.size for record in index.records.values()),
               "seconds": round(seconds, 3), "index_folder": str(sidecar.cache_folder()),
               "index_bytes": sum(Path(path).stat().st_size for path in records)}
    if args.output:
        summary["output"] = str(export_index(index, args.output))
    _print_summary(summary, args.json)
    return 0


def draw_index_progress(done: int, total: int) -> None:
    """``indexing video files: done/total``, redrawn on one line of a terminal's stderr."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        sys.stderr.write(f"\rindexing video files: {done}/{total}{end}")


def export_index(index: VideoIndex, output: str | Path) -> Path:
    """Write ``index``'s records to ``output`` as the publishable ZIP (SPEC §10.4), atomically;
    ``UsageError`` when a file has no stable identity (nothing could validate it)."""
    import zipfile

    from refstream import sidecar

    if any(not record.identity for record in index.records.values()):
        raise UsageError("some video file has no stable identity: a published index of it "
                         "could never be validated")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)

    def write(handle: BinaryIO) -> None:
        with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED) as archive:
            for path in sorted({record.path for record in index.records.values()}):
                info = zipfile.ZipInfo(Path(path).name, date_time=(1980, 1, 1, 0, 0, 0))
                archive.writestr(info, Path(path).read_bytes())

    sidecar.install(output, write)
    sidecar.fsync_directory(output.parent)
    return output


def add_inspect(subparsers) -> None:
    p = _command(subparsers, "inspect",
                 "show an MP4's boxes, video track, edit list, GOPs and sample table", run_inspect)
    p.add_argument("file", help="a local MP4 file")
    p.add_argument("--json", action="store_true",
                   help="print everything as JSON, with the whole sample table in decode order")
    p.add_argument("--head", type=int, default=10, help="sample table rows shown")


def run_inspect(args) -> int:
    import os

    from refstream.tools.inspect import describe

    if "://" in args.file:
        raise UsageError(f"{args.file}: inspect reads local MP4 files; download it first")
    try:
        with open(args.file, "rb") as f:
            head = f.read(8)
            box_type = head[4:].decode("latin-1")  # an MP4 starts with a box: size, then its type
            if len(head) == 8 and not (box_type.isascii() and box_type.isalnum()):
                raise UsageError(f"{args.file}: not an MP4 file (it starts with {head!r}): "
                                 "inspect reads local MP4 files")
            report = describe(lambda offset, length: os.pread(f.fileno(), length, offset),
                              os.fstat(f.fileno()).st_size, args.file)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc}") from exc
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['path']}: {report['file_size']} bytes")
    for box in report["boxes"]:
        print(f"{'  ' * box['depth']}{box['type']}  offset {box['offset']}  size {box['size']}")
    t = report["track"]
    print(f"video track {t['track_id']}: {t['codec']} {t['width']}x{t['height']}, timescale "
          f"{t['timescale']} (movie {t['movie_timescale']}), {t['samples']} samples, "
          f"{t['payload_bytes']} payload bytes")
    e = report["edit_list"]
    print("edit list: none" if e is None else
          f"edit list: empty {e['empty_duration']} movie ticks, media edit from media time "
          f"{e['media_time']} for {e['media_duration']} movie ticks")
    gops = report["gops"]
    sizes = sorted({g["samples"] for g in gops})
    print(f"GOPs: {len(gops)}, samples per GOP {sizes}; open GOPs (a sample presents before its "
          f"keyframe): {sum(g['first_pts'] < g['keyframe_pts'] for g in gops)}")
    s = report["samples"]
    print(f"{'#':>6} {'pts':>10} {'dts':>10} {'dur':>6} {'size':>8} {'offset':>10} key")
    for i in range(min(args.head, len(s["pts"]))):
        print(f"{i:>6} {s['pts'][i]:>10} {s['dts'][i]:>10} {s['duration'][i]:>6} "
              f"{s['size'][i]:>8} {s['offset'][i]:>10} {'K' if s['keyframe'][i] else ''}")
    return 0



def add_doctor(subparsers) -> None:
    p = _command(subparsers, "doctor", "check a dataset before training on it (exit 0: safe to "
                 "train, 1: not)", run_doctor, [_ROOT, _JSON])
    p.add_argument("--tolerance-s", type=float, default=1e-4,
                   help="how far a video frame may be from a requested time")
    p.add_argument("--decode", choices=("keyframes", "all"), default="keyframes",
                   help="decode every keyframe alone, or every frame the rows request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_doctor(args) -> int:
    from refstream.roots import open_source
    from refstream.tools.doctor import check_dataset, unreadable

    try:
        source = open_source(args.root)
    except RefstreamError as exc:  # e.g. the Hub does not know the revision
        report = unreadable(args.root, exc)
    else:
        with contextlib.closing(source):
            report = check_dataset(source, root=args.root, tolerance_s=args.tolerance_s,
                                   progress=False if args.no_progress else None, decode=args.decode)
    print(json.dumps(report.as_dict()) if args.json else report.table())
    return 0 if report.ok else 1



def add_bench(subparsers) -> None:
    p = _command(subparsers, "bench", "measure refstream side by side with map-style reading "
                 "and the decode ceiling, and its memory", run_bench, [_JSON])
    p.add_argument("--root", help="measure this dataset folder instead of generating one")
    p.add_argument("--quick", action="store_true", help="a tiny configuration that runs in seconds")
    for name, kind, text in (
            ("episodes", int, "episodes of the generated dataset"),
            ("frames-per-episode", int, "frames of each generated episode"),
            ("cameras", int, "cameras of the generated dataset"),
            ("gop", int, "keyframe interval of the generated videos"),
            ("bframes", int, "B-frames between references (h264 only)"),
            ("budget-gb", float, "byte budget per rank, GiB"),
            ("num-workers", int, "DataLoader workers"),
            ("batch-size", int, "DataLoader batch size"),
            ("repeats", int, "timed passes per method (medians are shown)")):
        p.add_argument(f"--{name}", type=kind, help=_bench_default(text, name.replace("-", "_")))
    p.add_argument("--pool-size", type=int, help="resident episodes per worker (default: 32 per "
                   "rank, split over the workers)")
    p.add_argument("--resolution", help=_bench_default("WxH of every camera", "width", "height"))
    p.add_argument("--codec", choices=["av1", "h264"],
                   help=_bench_default("codec of the generated videos", "codec"))
    p.add_argument("--plot", help="write a PNG of samples and memory over time (matplotlib)")
    p.add_argument("--first-batch", action="store_true",
                   help="instead: the time to first batch alone, of the configured dataset and "
                        "of 8 times its episodes (2 with --quick), in turn")
    p.add_argument("--scale", choices=["droid"],
                   help="instead: index build, construction and worker memory on a DROID-sized "
                        "simulation (sparse videos: no sample can be decoded from it); uses "
                        "--quick, --episodes, --num-workers and --json")


def _bench_default(text: str, *fields: str):
    """Help that names the bench's default, read only when help is shown (the bench imports
    torch)."""

    def help_text() -> str:
        from refstream.tools.bench import BenchConfig

        value = "x".join(str(getattr(BenchConfig(), name)) for name in fields)
        return f"{text} (default: {value})"

    return help_text


def _bench_progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr)


def run_bench(args) -> int:
    from refstream.tools.bench import BenchConfig, plot
    from refstream.tools.bench import run_bench as bench

    if args.scale:
        from refstream.tools.scale import ScaleConfig, run_scale

        given = {"episodes": args.episodes, "workers": args.num_workers}
        config = (ScaleConfig.quick if args.quick else ScaleConfig)(
            **{k: v for k, v in given.items() if v is not None})
        report = run_scale(config, progress=_bench_progress)
        print(json.dumps(report.as_dict()) if args.json else "\n".join(report.lines()))
        return 0

    overrides = {name: getattr(args, name) for name in (
        "root", "episodes", "frames_per_episode", "cameras", "gop", "bframes", "pool_size",
        "budget_gb", "num_workers", "batch_size", "repeats", "codec")
        if getattr(args, name) is not None}
    if args.resolution:
        width, _, height = args.resolution.lower().partition("x")
        if not (width.isdigit() and height.isdigit()):
            raise UsageError(f"--resolution: expected WxH such as 320x240, got {args.resolution}")
        overrides.update(width=int(width), height=int(height))
    config = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    if args.first_batch:
        from refstream.tools.bench import run_first_batch

        print("\n".join(run_first_batch(config, progress=_bench_progress)))
        return 0
    report = bench(config, progress=_bench_progress)
    print(json.dumps(report.as_dict()) if args.json else "\n".join(report.lines()))
    if args.plot and not plot(report, args.plot):
        print("bench: matplotlib is not installed: no plot", file=sys.stderr)
    return 0


# Each sub-command's add_<name>, in the order the help lists them.
def add_lerobot_train(subparsers) -> None:
    p = _command(subparsers, "lerobot-train", "run LeRobot's trainer (lerobot-train, from the "
                 "lerobot extra) on a StreamingDataset: give lerobot-train's own flags, e.g. "
                 "--policy.type=act --dataset.repo_id=OWNER/NAME --dataset.root=ROOT, where ROOT "
                 "may be a folder, an http(s):// URL or hf://datasets/OWNER/NAME[@REV] "
                 "(lerobot-train --help lists them)", run_lerobot_train)
    p.set_defaults(passthrough=True)  # every other argument is lerobot-train's


def run_lerobot_train(args) -> int:
    try:
        from refstream.tools.lerobot_train import main as train
    except ImportError as exc:
        raise UsageError(f"lerobot-train needs LeRobot: pip install 'refstream[lerobot]' "
                         f"({exc})") from exc
    return train(args.unknown)


COMMANDS = (add_conformance, add_demo, add_stream, add_plan, add_index, add_inspect, add_doctor,
            add_bench, add_lerobot_train)


if __name__ == "__main__":
    sys.exit(main())
