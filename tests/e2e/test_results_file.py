"""``--write``: a benchmark's printed table becomes its section of ``benchmarks/RESULTS.md``."""

import argparse
import datetime

import pytest

from benchmarks import results_file


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "RESULTS.md"
    monkeypatch.setattr(results_file, "RESULTS", path)
    return path


def run(argv: list[str], body) -> None:
    """A benchmark's main in small: the option, then the printing inside ``recorded``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.example", argv):
        body()


def test_a_run_with_write_keeps_what_it_printed(results, capsys):
    run(["--quick", "--write"], lambda: print("| case | ratio |\n| causal | 0.52 |"))
    assert "| causal | 0.52 |" in capsys.readouterr().out  # printed as usual too
    text = results.read_text()
    assert text.startswith(results_file.HEADER)
    assert "## `python -m benchmarks.example --quick`" in text  # the command, --write left out
    assert "| causal | 0.52 |" in text
    facts = text.split("`python -m benchmarks.example --quick`")[1].strip().splitlines()[0]
    assert f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}" in facts
    assert "commit " in facts and "load average" in facts and "cores" in facts


def test_a_later_run_replaces_only_its_own_section(results):
    run(["--write"], lambda: print("first table, first run"))
    run(["--quick", "--write"], lambda: print("second table"))
    run(["--write"], lambda: print("first table, second run"))
    found = results_file.sections(results.read_text())
    assert list(found) == ["python -m benchmarks.example", "python -m benchmarks.example --quick"]
    assert "first table, second run" in found["python -m benchmarks.example"]
    assert "first run" not in results.read_text()
    assert "second table" in found["python -m benchmarks.example --quick"]


def test_without_write_or_when_the_run_fails_nothing_is_written(results):
    run([], lambda: print("not kept"))
    assert not results.exists()

    def fails():
        print("half a table")
        raise RuntimeError("a peer was missing")

    with pytest.raises(RuntimeError):
        run(["--write"], fails)
    assert not results.exists()


def test_every_table_in_results_md_names_its_command_and_run():
    """The committed file holds only sections the option writes: each headed by a command of a
    benchmark module that exists, with the run's facts."""
    text = results_file.RESULTS.read_text()
    assert text.startswith(results_file.HEADER)
    for command, body in results_file.sections(text).items():
        module = command.split()[2]
        assert command.startswith("python -m benchmarks.")
        assert (results_file.RESULTS.parent / f"{module.split('.', 1)[1]}.py").exists(), command
        assert "commit " in body and "load average" in body and "```" in body
