"""One follower per run: a claim ref on the git origin that the first follower writes.

The claim is a commit on `refs/draftline/RUN/follower` whose message names the node and when it
claimed. A push that creates the ref succeeds once; a second follower's push of its own claim
is not a fast-forward and git refuses it, so two followers never both train the run. The node
that holds the claim may start again (a crash, a reboot): its name is kept in this clone's git
config. Another node takes over only when asked (`draftline follow --take-over`), after the
first is known gone.
"""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree


class ClaimRefused(SystemExit):
    """Another follower holds the run."""


def claim_ref(run_name: str) -> str:
    return f"refs/draftline/{run_name}/follower"


def node_name(root: Path) -> str:
    """This clone's name as a follower: host, folder and a random tag, kept in .git/config so
    the same clone is the same follower after a restart."""
    got = _git(root, "config", "--local", "draftline.node", check=False)
    if got.returncode == 0 and got.stdout.strip():
        return got.stdout.strip()
    name = f"{socket.gethostname()}:{root.resolve()}#{uuid.uuid4().hex[:8]}"
    _git(root, "config", "--local", "draftline.node", name)
    return name


def holder(root: Path, remote: str, run_name: str) -> dict | None:
    """The claim on the remote ({"node", "since"}), or None when nobody follows the run."""
    local = f"refs/remotes/{remote}/draftline/{run_name}/follower"
    fetched = _git(root, "fetch", "-q", remote, f"+{claim_ref(run_name)}:{local}", check=False)
    if fetched.returncode:
        if "couldn't find remote ref" in fetched.stderr:
            return None
        raise ClaimRefused(f"cannot read who follows run {run_name}: {fetched.stderr.strip()}")
    message = _git(root, "log", "-1", "--format=%B", local).stdout
    try:
        return json.loads(message)
    except json.JSONDecodeError:
        return {"node": message.strip()[:200], "since": "unknown"}


def claim(root: Path, remote: str, run_name: str, take_over: bool = False) -> str:
    """Claim the run for this clone; returns what to print. Refuses, naming the holder, when
    another node follows it (unless `take_over`)."""
    me = node_name(root)
    current = holder(root, remote, run_name)
    if current is not None and current.get("node") == me:
        return f"this node follows run {run_name} (claimed {current.get('since')})"
    if current is not None and not take_over:
        raise ClaimRefused(refusal(run_name, current))
    since = f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC"
    body = json.dumps({"node": me, "since": since})
    commit = _git(root, "commit-tree", EMPTY_TREE, "-m", body).stdout.strip()
    force = "+" if take_over else ""
    pushed = _git(root, "push", "-q", remote, f"{force}{commit}:{claim_ref(run_name)}", check=False)
    if pushed.returncode:
        now = holder(root, remote, run_name)
        if now is not None and now.get("node") != me:
            raise ClaimRefused(refusal(run_name, now))  # another follower claimed meanwhile
        raise ClaimRefused(f"cannot claim run {run_name}: {pushed.stderr.strip()}")
    if current is not None:
        return f"took run {run_name} over from {current.get('node')} ({current.get('since')})"
    return f"this node now follows run {run_name}"


def refusal(run_name: str, current: dict) -> str:
    return (
        f"run {run_name} is followed by {current.get('node')} since {current.get('since')}; "
        "if that node is gone for good, `draftline follow --take-over` here takes the run over"
    )


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and done.returncode:
        raise ClaimRefused(f"`git {' '.join(args[:2])}` failed: {done.stderr.strip()}")
    return done
