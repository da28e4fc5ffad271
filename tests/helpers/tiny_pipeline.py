"""A small, self-contained DVC pipeline in a temporary git repository, for salvage tests.

Shape of the real one: `prepare` (one folder, like curate) -> `shard@0..3` (foreach, like
generate@k) -> `combine` (depends on the parent folder of all shards, like validate). The
commands are deterministic Python; `combine` refuses to run unless every shard is present, the
same guard the real validate stage applies (expected row count), which is what stops the
`--allow-missing` hazard. The repository uses the project's own `.dvc/config`, with the bucket
and endpoint overridden in `.dvc/config.local` as a user would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.s3_server import S3Server, aws_env

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARDS = 4

PREPARE = """\
import os
os.makedirs("data/prepared", exist_ok=True)
for k in range({shards}):
    with open(f"data/prepared/in-{{k}}.txt", "w") as f:
        f.write("".join(f"prompt-{{k}}-{{i}}\\n" for i in range(6)))
"""

SHARD = """\
import hashlib, os, sys, time
k = int(sys.argv[1])
# Tests hold a shard "in flight" with this flag file (outside DVC's outputs).
while os.path.exists(f".draftline/hold-{k}"):
    time.sleep(0.1)
os.makedirs(".draftline", exist_ok=True)
with open(".draftline/ran.log", "a") as log:
    log.write(f"shard {k}\\n")
lines = open(f"data/prepared/in-{k}.txt").read().split()
os.makedirs("data/shards", exist_ok=True)
with open(f"data/shards/shard-{k}.txt", "w") as f:
    for line in lines:
        f.write(line + " " + hashlib.sha256(line.encode()).hexdigest() + "\\n")
"""

COMBINE = """\
import os, sys
expected = [f"shard-{{k}}.txt" for k in range({shards})]
found = sorted(f for f in os.listdir("data/shards") if f.startswith("shard-"))
if found != expected:
    sys.exit(f"combine: expected {{len(expected)}} shards, found {{len(found)}} ({{found}}): "
             "pull the finished shards with `dvc repro --pull` (not --allow-missing)")
with open("combined.txt", "w") as out:
    for name in expected:
        out.write(open("data/shards/" + name).read())
"""

BULK = """\
import hashlib, os
os.makedirs("data/bulk", exist_ok=True)
for i in range({files}):
    block = hashlib.sha256(str(i).encode()).digest() * ({kib} * 32)
    with open(f"data/bulk/part-{{i:03d}}.bin", "wb") as f:
        f.write(block)
"""

DVC_YAML = """\
stages:
  prepare:
    cmd: python prepare.py
    deps: [prepare.py]
    outs: [data/prepared]
  shard:
    foreach: {shard_ids}
    do:
      cmd: python shard.py ${{item}}
      deps: ["shard.py", "data/prepared/in-${{item}}.txt"]
      outs: ["data/shards/shard-${{item}}.txt"]
  combine:
    cmd: python combine.py
    deps: [combine.py, data/shards]
    outs: [combined.txt]
"""

BULK_STAGE = """\
  bulk:
    cmd: python bulk.py
    deps: [bulk.py]
    outs: [data/bulk]
"""


def run(
    cmd: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    return done


def base_env(tmp: Path, server: S3Server | None) -> dict[str, str]:
    """A clean environment: no real AWS settings of the machine, HOME inside the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home),
        GIT_CONFIG_NOSYSTEM="1",
        DVC_NO_ANALYTICS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    if server is not None:
        env.update(aws_env(server))
    else:
        env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def make_origin(tmp: Path, env: dict[str, str], bulk_files: int = 0, bulk_kib: int = 0) -> Path:
    """A bare 'origin' holding the pipeline's first commit; nodes clone it."""
    work = tmp / "seed"
    work.mkdir()
    run(["git", "init", "-q", "-b", "main"], work, env)
    run(["dvc", "init", "-q"], work, env)
    shutil.copy(REPO_ROOT / ".dvc" / "config", work / ".dvc" / "config")
    (work / "prepare.py").write_text(PREPARE.format(shards=SHARDS))
    (work / "shard.py").write_text(SHARD)
    (work / "combine.py").write_text(COMBINE.format(shards=SHARDS))
    dvc_yaml = DVC_YAML.format(shard_ids=list(range(SHARDS)))
    if bulk_files:
        (work / "bulk.py").write_text(BULK.format(files=bulk_files, kib=bulk_kib))
        dvc_yaml += BULK_STAGE
    (work / "dvc.yaml").write_text(dvc_yaml)
    (work / ".gitignore").write_text(".draftline/\nlogs/\n")  # as in the project
    run(["git", "add", "-A"], work, env)
    run(["git", "commit", "-qm", "pipeline"], work, env)
    origin = tmp / "origin.git"
    run(["git", "clone", "-q", "--bare", str(work), str(origin)], tmp, env)
    shutil.rmtree(work)
    return origin


def clone_node(
    origin: Path,
    dest: Path,
    env: dict[str, str],
    server: S3Server | None,
    bucket: str,
    jobs: int | None = None,
) -> Path:
    """A node: a fresh clone whose `.dvc/config.local` points the s3 remote at the test bucket."""
    run(["git", "clone", "-q", str(origin), str(dest)], origin.parent, env)
    point_remote(dest, server, bucket, jobs)
    return dest


def point_remote(node: Path, server: S3Server | None, bucket: str, jobs: int | None = None) -> None:
    """Set the s3 remote's url (and endpoint, jobs) in `.dvc/config.local`, keeping its other
    settings, through DVC's own config editor: what `dvc remote modify --local s3 ...` runs,
    without a `dvc` process each."""
    from dvc.config import Config

    with Config(str(node / ".dvc")).edit("local") as config:
        remote = config["remote"].setdefault("s3", {})
        remote["url"] = f"s3://{bucket}/dvc"
        if server is not None:
            remote["endpointurl"] = server.endpoint
        if jobs:
            remote["jobs"] = jobs


def copy_node(node: Path, tmp: Path, env: dict[str, str], server: S3Server, bucket: str) -> Path:
    """A copy in `tmp` of a prepared node and of the bare origin beside it (`origin.git`), the
    copy's git remote `origin` pointing at the copied origin and its DVC remote at `bucket`.
    `cp -a` keeps the hard links between the DVC cache and the workspace, as the node has
    them."""
    origin = tmp / "origin.git"
    run(["cp", "-a", str(node.parent / "origin.git"), str(origin)], tmp, env)
    copy = tmp / node.name
    run(["cp", "-a", str(node), str(copy)], tmp, env)
    run(["git", "remote", "set-url", "origin", str(origin)], copy, env)
    point_remote(copy, server, bucket)
    return copy


def salvage(
    node: Path, env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return run(
        [sys.executable, "-m", "draftline", "salvage", *args],
        node,
        env,
        check=False,
        timeout=timeout,
    )


def ran(node: Path) -> list[str]:
    log = node / ".draftline" / "ran.log"
    return log.read_text().splitlines() if log.exists() else []
