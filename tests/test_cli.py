"""The command line as a user meets it: every option explained with its default, ``--version``,
a wrong option answered with that command's usage, ``stream`` taking the dataset's options with
the dataset's defaults (ready batches too), an exact ``--max-samples``, every root form for
``plan`` and its warning about ranks without frames, ``inspect`` refusing what is not a local
MP4, a missing root, ``~``, and any refstream error — also one raised inside a DataLoader
worker — as one line (``-v``, before or after the sub-command: the traceback too)."""

from __future__ import annotations

import argparse
import inspect
import json
import sys

import pytest

from refstream import __version__
from refstream.tools.cli import STREAM_OPTIONS, build_parser, main
from refstream.tools.conformance import FIXTURES_DIR
from refstream.tools.demo import serve_directory, write_demo_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "ds"
    write_demo_dataset(root, episode_lengths=(6, 5, 7), size=(32, 24))
    return root


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_option_has_help_and_shows_its_default(name):
    parser = subcommands()[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {action.default})" in text, (name, action.option_strings)
    assert "issue" not in text and "``" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"refstream {__version__}"


def test_a_wrong_option_gets_that_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["stream", "somewhere", "--no-such-option"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: refstream stream ")
    assert "unrecognized arguments: --no-such-option" in err


def test_lerobot_train_hands_every_other_argument_to_lerobot(monkeypatch, capsys):
    received = []
    module = type(sys)("refstream.tools.lerobot_train")  # stands in for LeRobot's trainer
    module.main = lambda argv: received.append(argv) or 0
    monkeypatch.setitem(sys.modules, "refstream.tools.lerobot_train", module)
    flags = ["--policy.type=act", "--dataset.root", "http://127.0.0.1:1/", "--steps=5"]
    assert main(["lerobot-train", *flags]) == 0
    assert received == [flags]


def test_lerobot_train_without_lerobot_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lerobot", None)  # what importing it finds: nothing
    monkeypatch.delitem(sys.modules, "refstream.tools.lerobot_train", raising=False)
    assert main(["lerobot-train", "--policy.type=act"]) == 2
    assert "pip install 'refstream[lerobot]'" in capsys.readouterr().err


def test_stream_options_are_the_datasets_with_its_defaults():
    from refstream.stream import StreamingDataset

    defaults = {name: p.default for name, p in
                inspect.signature(StreamingDataset.__init__).parameters.items()}
    parser = subcommands()["stream"]
    given = {a.dest: a.default for a in parser._actions}
    for name in STREAM_OPTIONS:
        assert given[name] == defaults[name], name


def test_max_samples_is_exact(dataset, capsys):
    assert main(["stream", str(dataset), "--max-samples", "5", "--batch-size", "4",
                 "--num-workers", "0", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 5


def test_stream_passes_the_datasets_options(dataset, capsys):
    assert main(["stream", str(dataset), "--strategy", "round_robin", "--pool-size", "2",
                 "--uint8", "--decode-threads", "1", "--prefetch-episodes", "1",
                 "--num-workers", "0", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 18


def test_plan_takes_a_url(dataset, capsys):
    with serve_directory(dataset) as server:
        assert main(["plan", server.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["frames"] == 18


def test_an_error_in_a_worker_is_one_line(dataset, capsys):
    # a budget no episode fits in: raised inside the DataLoader worker
    argv = ["stream", str(dataset), "--byte-budget-gb", "1e-7", "--num-workers", "1",
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("refstream stream: EpisodeTooLarge: episode "), err
    assert main([*argv, "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
        "refstream stream: EpisodeTooLarge: ")


def test_an_unknown_conformance_kind_is_a_usage_error(capsys):
    assert main(["conformance", "--kind", "no-such-kind"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"refstream conformance: UsageError: no case of kind 'no-such-kind' in {FIXTURES_DIR}")


def test_an_error_from_a_worker_reaches_python_as_one_line(dataset):
    from torch.utils.data import DataLoader

    from refstream.errors import EpisodeTooLarge
    from refstream.stream import StreamingDataset

    loader = DataLoader(StreamingDataset(dataset, byte_budget_gb=1e-7), num_workers=1)
    with pytest.raises(EpisodeTooLarge) as raised:
        next(iter(loader))
    message = str(raised.value)
    assert "\n" not in message and message.endswith("(in DataLoader worker process 0)")
    assert message.startswith("episode ")
    assert "Traceback" in raised.value.worker_traceback


def test_stream_batched_takes_the_ready_batches_path_with_the_same_batches(dataset, capsys,
                                                                           monkeypatch):
    from refstream.tools import demo

    batched = []

    def spy(dataset, **options):
        batched.append(dataset.batched)
        return consume(dataset, **options)

    consume = demo.consume
    monkeypatch.setattr(demo, "consume", spy)
    argv = ["stream", str(dataset), "--batch-size", "4", "--num-workers", "2", "--json",
            "--no-progress"]
    assert main([*argv, "--batched"]) == 0
    ready = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert batched == [True, False]
    assert ready["batched"] is True and plain["batched"] is False
    assert ready["samples"] == plain["samples"] == 18
    assert ready["batches"] == plain["batches"]


def test_plan_and_stream_default_to_the_same_worker_count():
    commands = subcommands()
    defaults = {name: commands[name].get_default("num_workers") for name in ("plan", "stream")}
    assert defaults["plan"] == defaults["stream"] == 2, defaults


def test_plan_warns_about_the_ranks_without_frames(dataset, capsys):
    from refstream.errors import ShardingError
    from refstream.stream import StreamingDataset

    with pytest.raises(ShardingError):  # the truth the warning announces (3 episodes)
        StreamingDataset(dataset, rank=3, world_size=4, batch_size=1)
    assert main(["plan", str(dataset), "--world-size", "4", "--num-workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "rank(s) 3 of world size 4 own no frames" in err and "at most 3" in err
    assert main(["plan", str(dataset), "--world-size", "3", "--num-workers", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_inspect_says_it_reads_local_mp4_files(dataset, capsys):
    parquet = next(dataset.glob("data/*/*.parquet"))
    for target in ("http://127.0.0.1:9/video.mp4", str(parquet), str(dataset / "meta/info.json")):
        assert main(["inspect", target]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"refstream inspect: UsageError: {target}: "), err
        assert "inspect reads local MP4 files" in err and "Errno" not in err
    assert main(["inspect", str(next(dataset.glob("videos/*/*/*.mp4"))), "--json"]) == 0


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_works_before_or_after_the_command(tmp_path, capsys, where):
    argv = ["plan", str(tmp_path / "absent")]
    assert main(["-v", *argv] if where == "before" else [*argv, "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
        "refstream plan: UsageError: ")
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_missing_root_is_no_such_folder_and_tilde_is_expanded(dataset, tmp_path, capsys,
                                                                 monkeypatch):
    from refstream.stream import StreamingDataset

    assert main(["stream", str(tmp_path / "absent"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"refstream stream: UsageError: '{tmp_path / 'absent'}': no such folder")
    monkeypatch.setenv("HOME", str(dataset.parent))
    assert main(["plan", f"~/{dataset.name}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["frames"] == 18
    assert StreamingDataset(f"~/{dataset.name}").num_frames == 18
    assert main(["plan", "~/absent"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"refstream plan: UsageError: '~/absent': no such folder ({dataset.parent / 'absent'})")
