"""The CLI's errors: a user's mistake ends in one line naming the fix; --verbose keeps the
traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from draftline import cli
from draftline.core import target
from draftline.runtime import atomic, params

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_hydra_typo_is_one_line_with_the_options(tmp_path: Path, capsys):
    out = str(tmp_path / "params.yaml")
    assert cli.main(["compose", "model=qwen3_9b", "--output", out, "--config-dir", CONF]) == 1
    line = one_line(capsys.readouterr().err)
    assert line == (
        "draftline compose: In 'config': Could not find 'model/qwen3_9b'; Available options in "
        "'model': qwen3_6_27b, qwen3_8b, tiny, tiny_qwen36 (--verbose for the traceback)"
    )
    with pytest.raises(MissingConfigException):
        cli.main(["--verbose", "compose", "model=qwen3_9b", "--output", out, "--config-dir", CONF])


def test_unknown_key_names_the_key_it_meant(capsys):
    assert cli.main(["plan", "modle=qwen3_8b", "--config-dir", CONF]) == 1
    assert "unknown key modle; did you mean model?" in one_line(capsys.readouterr().err)


def test_output_under_a_file_is_one_line(tmp_path: Path, capsys):
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "params.yaml")
    assert cli.main(["compose", "--output", out, "--config-dir", CONF]) == 1
    line = one_line(capsys.readouterr().err)
    assert (
        f"{tmp_path / 'file'}: " in line and "each folder on it must exist and be a folder" in line
    )


def test_unwritable_output_folder_names_the_fix(tmp_path: Path, monkeypatch, capsys):
    # Tests may run as root, for whom no folder is unwritable: raise what a user would get.
    def denied(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(atomic, "write_text", denied)
    assert cli.main(["compose", "--output", "/srv/params.yaml", "--config-dir", CONF]) == 1
    assert one_line(capsys.readouterr().err) == (
        "draftline compose: /srv/params.yaml: Permission denied; choose a folder you can write "
        "to (--out/--output) or fix its permissions (--verbose for the traceback)"
    )


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(path, text):
        raise KeyError("oops")

    monkeypatch.setattr(atomic, "write_text", bug)
    with pytest.raises(KeyError):
        cli.main(["compose", "--output", "x.yaml", "--config-dir", CONF])


def test_stage_with_a_missing_model_path_fails_in_one_line(tmp_path: Path, repo_root: Path):
    missing = tmp_path / "models" / "my-target"
    p = tmp_path / "params.yaml"
    p.write_text(params.to_yaml(params.compose([f"model.path={missing}"], CONF)))
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "curate", "--params", str(p), "--out", "curated"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert one_line(proc.stderr) == (
        f"model.path {missing} does not exist: point it at a Hugging Face model folder or hub id "
        "(`draftline compose model=tiny model.path=/path/to/model` or path in "
        "conf/model/tiny.yaml)"
    )
    assert not (tmp_path / "curated").exists()


@pytest.mark.parametrize(
    ("path", "local"),
    [("Qwen/Qwen3-8B", False), ("gpt2", False), ("./x", True), ("/m/x", True), ("a/b/c", True)],
)
def test_hub_ids_and_local_paths(path: str, local: bool, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert target.is_local(path) is local
    (tmp_path / "Qwen").mkdir()  # a folder here named like the org: a local path
    assert target.is_local("Qwen/Qwen3-8B") is True


def test_a_connection_error_is_not_mistaken_for_a_path(monkeypatch):
    def refused(path, text):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(atomic, "write_text", refused)
    with pytest.raises(ConnectionRefusedError):
        cli.main(["compose", "--output", "x.yaml", "--config-dir", CONF])


def test_every_option_of_every_command_has_help():
    import argparse
    import importlib

    for name, (module, _) in cli.COMMANDS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        bare = [a.dest for a in parser._actions if a.help is None and a.dest != "help"]
        assert not bare, (name, bare)


@pytest.mark.parametrize("name", ["serve", "bench", "generate", "plan"])
def test_help_prints_one_example_per_line(name: str, capsys):
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    text = capsys.readouterr().out
    examples = [line.strip() for line in text.splitlines() if line.startswith("  draftline ")]
    assert len(examples) >= 2, text
    for line in examples:  # one command per line, never two run together
        assert line.count("draftline ") == 1, line


def test_plan_help_names_a_docs_section_that_exists(repo_root: Path, capsys):
    import re

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    named = re.findall(r'docs/pipeline\.md,\s+"([^"]+)"', capsys.readouterr().out)
    assert named, "plan --help names no docs section"
    headings = (repo_root / "docs/pipeline.md").read_text().splitlines()
    for section in named:
        assert f"## {section}" in headings, section
