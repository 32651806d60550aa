"""The command line as a user meets it: every option explained with its default, ``--version``,
a wrong option answered with that command's usage, ``stream`` taking the dataset's options with
the dataset's defaults, an exact ``--max-samples``, every root form for ``plan``, and any
refstream error — also one raised inside a DataLoader worker — as one line (``-v``: the
traceback too)."""

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
        if action.option_strings and action.default not in (None, False):
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
    assert "\n" not in message and message.endswith("(in DataLoader worker 0)")
    assert message.startswith("episode ")
    assert "Traceback" in raised.value.worker_traceback
