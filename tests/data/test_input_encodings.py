"""Input files saved as UTF-16 or UTF-32 fail by name, with the iconv command that converts
them, instead of each line being rejected as malformed JSON."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from draftline.data.input_files import (
    BrokenInputFiles,
    list_input_files,
    other_encoding,
    read_files,
)


def read_all(source: Path) -> list[str | None]:
    """The parse error (None for a good row) of every row in `source`."""
    files, _ = list_input_files([str(source)])
    return [row.error and row.error.reason for batch in read_files(files) for row in batch.rows()]


def test_utf16_and_utf32_files_are_named_before_any_row(tmp_path: Path) -> None:
    """With or without a byte-order mark, gzipped or not: each file is named with the encoding
    iconv needs, and none of its lines is read as a row."""
    folder = tmp_path / "in"
    folder.mkdir()
    text = '{"prompt": "hello"}\n'
    for name, encoding in [
        ("bom16.jsonl", "utf-16"), ("le.jsonl", "utf-16-le"), ("be.json", "utf-16-be"),
        ("bom32.jsonl", "utf-32"),
    ]:  # fmt: skip
        (folder / name).write_bytes(text.encode(encoding))
    (folder / "gz16.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-16"), mtime=0))
    with pytest.raises(BrokenInputFiles) as err:
        read_all(folder)
    lines = str(err.value).splitlines()
    assert lines[0] == "5 input files are not UTF-8:"
    named = {Path(line.split(":")[0].strip()).name: line.split(": ")[1] for line in lines[1:]}
    assert named == {
        "be.json": "UTF-16BE text, not UTF-8", "bom16.jsonl": "UTF-16 text, not UTF-8",
        "bom32.jsonl": "UTF-32 text, not UTF-8", "gz16.jsonl.gz": "UTF-16 text, not UTF-8",
        "le.jsonl": "UTF-16LE text, not UTF-8",
    }  # fmt: skip
    (gz_line,) = [line for line in lines if "gz16.jsonl.gz:" in line]
    assert "(`gunzip -c " in gz_line and "| iconv -f UTF-16 -t UTF-8 | gzip > " in gz_line
    (folder / "cut.json").write_text('[{"prompt": ')
    with pytest.raises(BrokenInputFiles, match="are not UTF-8, or cut short, corrupt or empty:"):
        read_all(folder)


def test_utf8_json_is_not_taken_for_another_encoding(tmp_path: Path) -> None:
    for head in (b'{"pr', b"[{", b"  {", b"\xef\xbb\xbf{", b"", b"{"):
        assert other_encoding(head) is None, head
    # A stray NUL later in a UTF-8 file is still one rejected row, not a file in UTF-16.
    (tmp_path / "nul.jsonl").write_bytes(b'{"prompt": "a"}\n\x00{\n')
    assert read_all(tmp_path / "nul.jsonl") == [None, "malformed_json"]
