"""Coverage-guided fuzzing of the MP4 parser and the sidecar readers with atheris, on demand.

Not a pytest module (its name does not start with ``test_``); run it by hand::

    pip install atheris
    python tests/fuzz_atheris.py mp4 -atheris_runs=2000000
    python tests/fuzz_atheris.py record -max_total_time=600
    python tests/fuzz_atheris.py published

The target is ``mp4`` (``refstream.mp4.parse_index`` through a ``read_range`` that fails on a read
outside the file), ``record`` (``refstream.sidecar.read_record`` of one file's index record, as
workers map it) or ``published`` (records taken from a published index into a cache). The seed
corpus — the MP4s of ``spec/fixtures/mp4``, or the index built from them — is written to a
temporary directory that libFuzzer mutates from. The checks are tests/test_fuzz.py's: an input
must parse into a coherent index or raise a ``RefstreamError``; any other exception or failed
assertion is a crash, and libFuzzer saves the input. Time and memory per input are bounded by
libFuzzer's ``-timeout`` and ``-rss_limit_mb`` (defaults below unless given on the command line).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # refstream, without installing

TARGETS = ("mp4", "record", "published")
DEFAULT_FLAGS = ("-timeout=2", "-rss_limit_mb=1024")


def write_corpus(test_fuzz, target: str, directory: Path, workdir: Path):
    """Seed files for ``target`` in ``directory``; returns the one-input check."""
    if target == "mp4":
        for name, seed in test_fuzz.MP4.items():
            (directory / f"{name}.mp4").write_bytes(seed.data)
        return lambda data: test_fuzz.check_mp4("atheris", data)
    seed = test_fuzz.build_sidecar_seed(workdir / "dataset", workdir)
    if target == "record":
        relpath = sorted(seed.data)[0]
        (directory / "record.npy").write_bytes(seed.data[relpath])
        return lambda data: test_fuzz.check_record(seed, "atheris", data, relpath, verify=False)
    (directory / "published.npz").write_bytes(seed.published)
    return lambda data: test_fuzz.check_published(seed, "atheris", data)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: python {argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer flags]")
    try:
        import atheris
    except ImportError:
        sys.exit("atheris is not installed: pip install atheris")
    # refstream's modules get coverage instrumentation; the test helpers and libraries do not
    with atheris.instrument_imports(include=["refstream"]):
        import test_fuzz
    target, flags = argv[1], argv[2:]
    flags += [f for f in DEFAULT_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
    with tempfile.TemporaryDirectory(prefix=f"refstream-atheris-{target}-") as temp:
        corpus, workdir = Path(temp) / "corpus", Path(temp) / "work"
        corpus.mkdir()
        workdir.mkdir()
        check = write_corpus(test_fuzz, target, corpus, workdir)
        atheris.Setup([argv[0], *flags, str(corpus)], check)
        atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
