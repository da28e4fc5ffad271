"""`kill -9` of a whole `dvc repro` at one phase boundary of a generate stage, for the tests.

Put this folder first on PYTHONPATH, start `dvc repro` in its own process group and set
$DRAFTLINE_TEST_KILL_AT to one phase; every Python process of the run (DVC and the stage it
starts) imports this module at startup, and the first to reach the phase SIGKILLs the group,
as a node losing power would:

  journaled  the stage has journaled every turn, before it writes the table
  table      the table is renamed into place, before the run log and the table's record
  recorded   the table's record (`.done.json`) is written: the stage's last write
  dvc-save   the stage exited, DVC has not hashed its output yet
  dvc-commit DVC hashed the output and is about to move it into its cache
"""

from __future__ import annotations

import os
import signal

PHASE = os.environ.get("DRAFTLINE_TEST_KILL_AT", "")


def _kill() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _after_generated_table(write_parquet):  # type: ignore[no-untyped-def]
    def wrapped(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        table = "data/generated/" in str(path)
        if table and PHASE == "journaled":
            _kill()
        write_parquet(path, *args, **kwargs)
        if table and PHASE == "table":
            _kill()

    return wrapped


def _after_record(write_json):  # type: ignore[no-untyped-def]
    def wrapped(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        write_json(path, *args, **kwargs)
        if str(path).endswith(".done.json"):
            _kill()

    return wrapped


def _before(method):  # type: ignore[no-untyped-def]
    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        _kill()
        return method(*args, **kwargs)

    return wrapped


if PHASE in ("journaled", "table", "recorded"):
    from draftline.runtime import atomic

    atomic.write_parquet = _after_generated_table(atomic.write_parquet)
    if PHASE == "recorded":
        atomic.write_json = _after_record(atomic.write_json)
elif PHASE in ("dvc-save", "dvc-commit"):
    try:
        from dvc.stage import Stage
    except ImportError:  # a Python process without DVC
        pass
    else:
        name = PHASE.removeprefix("dvc-")
        setattr(Stage, name, _before(getattr(Stage, name)))
