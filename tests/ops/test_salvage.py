"""`draftline salvage` end to end: real git, real `dvc` subprocesses, a real S3 HTTP endpoint
(moto's ThreadedMotoServer on 127.0.0.1), and the faults a node meets when it is shut down."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.s3_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, S3Server
from helpers.tiny_pipeline import (
    base_env,
    clone_node,
    copy_node,
    make_origin,
    run,
    salvage,
)

HF_TOKEN = "hf_SalvageTestToken_9d8c7b6a"
DB_PASSWORD = "pw-salvage-4711-private"


@pytest.fixture
def env(env: dict[str, str]) -> dict[str, str]:
    """tests/ops/conftest.py's, with secrets in it that no report or push may carry."""
    return {**env, "HF_TOKEN": HF_TOKEN, "DB_PASSWORD": DB_PASSWORD}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, server: S3Server) -> Path:
    """Node A as built once per module: a clone with prepare + 2 of 4 shards finished."""
    tmp = tmp_path_factory.mktemp("prepared")
    env = base_env(tmp, server)
    origin = make_origin(tmp, env)
    node = clone_node(origin, tmp / "node-a", env, server, "unused")
    run(["dvc", "repro", "prepare", "shard@0", "shard@1"], node, env)
    return node


@pytest.fixture
def node(
    prepared: Path, tmp_path: Path, env: dict[str, str], server: S3Server, bucket: str
) -> Path:
    """Node A: a copy of `prepared` and its origin in this test's folder, on its own bucket."""
    return copy_node(prepared, tmp_path, env, server, bucket)


def lock_objects(node: Path) -> dict[str, str]:
    """oid -> workspace path for every output in dvc.lock, `.dir` entries included."""
    lock = yaml.safe_load((node / "dvc.lock").read_text())
    found = {}
    for entry in lock["stages"].values():
        for out in entry.get("outs", []):
            found[out["md5"]] = out["path"]
            if out["md5"].endswith(".dir"):
                manifest = cache_path(node, out["md5"]).read_text()
                for item in yaml.safe_load(manifest):
                    found[item["md5"]] = f"{out['path']}/{item['relpath']}"
    return found


def cache_path(node: Path, oid: str) -> Path:
    return node / ".dvc" / "cache" / "files" / "md5" / oid[:2] / oid[2:]


def remote_key(oid: str) -> str:
    return f"dvc/files/md5/{oid[:2]}/{oid[2:]}"


def no_secrets(*texts: str) -> None:
    for text in texts:
        for secret in (HF_TOKEN, DB_PASSWORD, SECRET_ACCESS_KEY, ACCESS_KEY_ID):
            assert secret not in text


def test_salvage_pushes_stages_shards_run_cache_verifies_and_commits(
    node: Path, env: dict[str, str], server: S3Server, bucket: str, tmp_path: Path
) -> None:
    logs = node / "logs"
    logs.mkdir()
    (logs / "generate.log").write_text(
        f"starting with token {HF_TOKEN}\nfetch https://u:{DB_PASSWORD}@db.example/x\nok\n"
    )
    done = salvage(node, env, "--stop-servers")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "VERDICT: SAFE" in out
    assert "prepare, shard@0, shard@1" in out and "dvc repro --pull" in out

    # Every object dvc.lock names -- directory entries included -- and the run-cache are there.
    keys = set(server.keys(bucket))
    for oid in lock_objects(node):
        assert remote_key(oid) in keys
    runs = [p for p in (node / ".dvc" / "cache" / "runs").rglob("*") if p.is_file()]
    assert len(runs) == 3
    assert len([k for k in keys if k.startswith("dvc/runs/")]) == 3

    # dvc.lock and the notes are committed and pushed to origin.
    pulled = tmp_path / "check"
    run(["git", "clone", "-q", str(tmp_path / "origin.git"), str(pulled)], tmp_path, env)
    assert (pulled / "dvc.lock").read_text() == (node / "dvc.lock").read_text()
    notes = list((pulled / "notes" / "salvage").glob("*/NOTES.md"))
    assert len(notes) == 1
    folder = notes[0].parent
    assert (folder / "node.json").exists() and (folder / "salvage.json").exists()
    gathered = (folder / "logs" / "logs" / "generate.log").read_text()
    assert "starting with token ***" in gathered and "https://***@db.example/x" in gathered
    assert "dvc repro --pull" in notes[0].read_text()
    no_secrets(out, *(p.read_text() for p in folder.rglob("*") if p.is_file()))

    # Nothing left to do: a second salvage is SAFE too.
    again = salvage(node, env)
    assert again.returncode == 0, again.stdout


GH_PAT = "ghp_Rk2Lm9Qx7Wz4Tn8Vb3Jc6Hd1Fs5Gp0Ya7Ue"
DB_PASS = "Salv4ge-db-pass-0042"
WEBHOOK_SECRET = "Wh00kS3cretPathValue42"
WEBHOOK = f"https://hooks.slack.com/services/T0SALVAGE/B0SALVAGE/{WEBHOOK_SECRET}"
API_KEY = "mk-4471-private-key"
API_URL = f"https://metrics.example/ingest?project=draftline&api_key={API_KEY}"
CONFIG_KEY_ID = "AKIACONFIGLOCAL00042"
CONFIG_SECRET = "cfg-local-secret-Hq7Zt2Nw9"
LOG_AWS_SECRET = "Tq9vR2mXw7LkP4sZ8nB1cF6hJ3dG5yU0aEiOQe/x"  # in no config: known by shape


def test_notes_keep_no_secret_of_any_shape(node: Path, env: dict[str, str], tmp_path: Path) -> None:
    """Secrets whose names say nothing (GH_PAT, DB_PASS, URLs), credentials of
    .dvc/config.local and an AWS secret key, all echoed into a log, reach no committed file."""
    env.update(
        GH_PAT=GH_PAT,
        DB_PASS=DB_PASS,
        NOTIFY_URL=WEBHOOK,
        METRICS_URL=API_URL,
        CUDA_VISIBLE_DEVICES="0,1",
    )
    # The push authenticates with the credentials of .dvc/config.local, not the environment.
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    run(["dvc", "remote", "modify", "--local", "s3", "access_key_id", CONFIG_KEY_ID], node, env)
    run(["dvc", "remote", "modify", "--local", "s3", "secret_access_key", CONFIG_SECRET], node, env)
    (node / "logs").mkdir()
    (node / "logs" / "train.log").write_text(
        f"git clone https://x:{GH_PAT}@github.com/org/repo\n"
        f"db connect password={DB_PASS}\n"
        f"notify {WEBHOOK}\n"
        f"POST {API_URL}\n"
        f"dvc config: access_key_id={CONFIG_KEY_ID} secret {CONFIG_SECRET}\n"
        f"boto debug: loaded credentials {LOG_AWS_SECRET} from ~/.aws\n"
        "step 10 loss=1.25 max_new_tokens=2048\n"
    )
    done = salvage(node, env)
    assert done.returncode == 0, done.stdout + done.stderr

    pulled = tmp_path / "check"
    run(["git", "clone", "-q", str(tmp_path / "origin.git"), str(pulled)], tmp_path, env)
    folder = next((pulled / "notes" / "salvage").iterdir())
    committed = {p: p.read_text() for p in folder.rglob("*") if p.is_file()}
    planted = (GH_PAT, DB_PASS, WEBHOOK_SECRET, API_KEY, CONFIG_KEY_ID, CONFIG_SECRET)
    for text in (done.stdout, done.stderr, *committed.values()):
        for secret in (*planted, LOG_AWS_SECRET):
            assert secret not in text
    log = committed[folder / "logs" / "logs" / "train.log"]
    # The environment's secret values go whole; the rest only where a secret is.
    assert "notify ***\nPOST ***\n" in log and "password=***" in log
    assert "step 10 loss=1.25 max_new_tokens=2048" in log
    # The snapshot keeps values by allow-list: the planted variables are named, no more.
    environment = yaml.safe_load(committed[folder / "node.json"])["environment"]
    assert environment["values"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert not {"GH_PAT", "DB_PASS", "NOTIFY_URL", "METRICS_URL"} & set(environment["values"])
    assert {"GH_PAT", "DB_PASS", "NOTIFY_URL", "METRICS_URL"} <= set(environment["names_only"])


def test_dry_run_prints_the_plan_and_changes_nothing(
    node: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    """Every check that writes nothing runs, git's included, and the verdict it would give:
    here NOT SAFE (exit 1), as nothing is pushed yet and a script is not committed."""
    head = run(["git", "rev-parse", "HEAD"], node, env).stdout
    (node / "scratch.sh").write_text("echo hi\n")
    done = salvage(node, env, "--dry-run", "--stop-servers")
    assert done.returncode == 1, done.stdout + done.stderr
    for step in (
        "dvc push --run-cache -r s3",
        "verify that the remote holds every object",
        "dvc exp push <git remote> --all-commits -r s3",
        "draftline serve stop",
        "git commit dvc.lock, params.yaml",
    ):
        assert step in done.stdout
    assert "WOULD BE LOST 3 stages/files not intact in s3://" in done.stdout
    assert "SAFE      git: the salvage commit would be pushed to origin" in done.stdout
    assert "NOT SAFE  1 untracked files, not saved: scratch.sh" in done.stdout
    assert "SAFE      experiments: none on this node" in done.stdout
    assert "dvc.lock" not in done.stdout.split("untracked files")[1]  # salvage commits it
    assert "VERDICT (dry run, nothing changed): NOT SAFE" in done.stdout
    assert server.keys(bucket) == []
    assert run(["git", "rev-parse", "HEAD"], node, env).stdout == head
    assert not (node / "notes").exists()
    no_secrets(done.stdout)


def test_missing_credentials_is_not_safe_and_names_the_fix(
    node: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    done = salvage(node, env, "--no-push-git")
    assert done.returncode == 1
    assert "NOT SAFE  no AWS credentials found for remote 's3'" in done.stdout
    assert "export AWS_ACCESS_KEY_ID=" in done.stdout
    assert "dvc remote modify --local s3 access_key_id" in done.stdout
    assert server.keys(bucket) == []


def test_missing_and_corrupted_remote_objects_are_detected(
    node: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    assert salvage(node, env).returncode == 0
    objects = {path: oid for oid, path in lock_objects(node).items()}
    client = server.client()
    # Corrupted: same key, other bytes (dvc push skips keys that exist, so it stays corrupted).
    client.put_object(
        Bucket=bucket, Key=remote_key(objects["data/shards/shard-0.txt"]), Body=b"bit rot\n"
    )
    # Missing, with no local copy to push again: a shard and one entry of a directory output.
    for path in ("data/shards/shard-1.txt", "data/prepared/in-2.txt"):
        client.delete_object(Bucket=bucket, Key=remote_key(objects[path]))
        cache_path(node, objects[path]).unlink()

    done = salvage(node, env, "--no-push-git")
    assert done.returncode == 1, done.stdout
    assert (
        "corrupted in s3://" in done.stdout and "data/shards/shard-0.txt (shard@0)" in done.stdout
    )
    assert "ETag (content MD5)" in done.stdout
    assert "missing in s3://" in done.stdout
    assert "data/shards/shard-1.txt (shard@1" in done.stdout
    assert "data/prepared/in-2.txt (prepare" in done.stdout
    assert "VERDICT: NOT SAFE" in done.stdout
    # Intact in the workspace: the fastest fix puts it back into the cache, not a rerun.
    assert "fix: `dvc commit -f shard@1`, then `draftline salvage` again" in done.stdout
    assert "re-run the stage" not in done.stdout

    deep = salvage(node, env, "--no-push-git", "--deep")
    assert deep.returncode == 1 and "content MD5" in deep.stdout
    assert "downloaded and hashed" in deep.stdout

    run(["dvc", "commit", "-f", "shard@1"], node, env)
    fixed = salvage(node, env, "--no-push-git")
    assert "data/shards/shard-1.txt (shard@1" not in fixed.stdout.split("VERDICT")[0]


def test_object_lost_from_a_folder_output_is_repaired(
    node: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    """`dvc push` takes a folder whose .dir manifest is on the remote for complete, so it never
    sends a lost entry again: salvage uploads it from the local cache, says so, ends SAFE."""
    assert salvage(node, env).returncode == 0
    oid = {path: oid for oid, path in lock_objects(node).items()}["data/prepared/in-2.txt"]
    server.client().delete_object(Bucket=bucket, Key=remote_key(oid))

    done = salvage(node, env)
    assert done.returncode == 0, done.stdout
    assert (
        f"SAFE      repaired s3://{bucket}/dvc: uploaded 1 missing objects from the local cache"
        in done.stdout
    )
    assert "data/prepared/in-2.txt (prepare)" in done.stdout
    assert "VERDICT: SAFE" in done.stdout
    assert remote_key(oid) in server.keys(bucket)


def put_multipart(client: Any, bucket: str, key: str, body: bytes, part_size: int) -> str:
    """Upload `body` in parts, as large files are: the ETag is then no MD5 of the content."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, start in enumerate(range(0, len(body), part_size), 1):
        chunk = body[start : start + part_size]
        etag = client.upload_part(
            Bucket=bucket, Key=key, PartNumber=number, UploadId=upload, Body=chunk
        )["ETag"]
        parts.append({"ETag": etag, "PartNumber": number})
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    return str(client.head_object(Bucket=bucket, Key=key)["ETag"])


def test_multipart_object_corrupted_at_same_size_is_not_safe(
    tmp_path: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    """A multipart ETag is the MD5 of the parts' MD5s: salvage recomputes it from the local
    copy, so a same-size corruption is found without --deep (the size alone passed it)."""
    origin = make_origin(tmp_path, env, bulk_files=1, bulk_kib=6 * 1024)
    node = clone_node(origin, tmp_path / "node", env, server, bucket)
    run(["dvc", "repro", "bulk"], node, env)
    assert salvage(node, env).returncode == 0
    (path, oid), *_ = ((p, o) for o, p in lock_objects(node).items() if p.endswith(".bin"))
    body = cache_path(node, oid).read_bytes()
    client = server.client()
    part = 5 * 2**20  # S3's smallest part: 6 MiB go up as 5 MiB + 1 MiB
    assert put_multipart(client, bucket, remote_key(oid), body, part).endswith('-2"')

    intact = salvage(node, env)
    assert intact.returncode == 0, intact.stdout
    assert "1 by multipart ETag of the local copy" in intact.stdout

    rotten = body[:-1] + bytes([body[-1] ^ 0xFF])
    put_multipart(client, bucket, remote_key(oid), rotten, part)
    done = salvage(node, env)
    assert done.returncode == 1, done.stdout
    assert f"corrupted in s3://{bucket}/dvc: {path} (bulk): multipart ETag" in done.stdout
    assert "VERDICT: NOT SAFE" in done.stdout


def test_shard_in_flight_journal_and_uncommitted_files_are_not_safe(
    node: Path, env: dict[str, str]
) -> None:
    hold = node / ".draftline" / "hold-2"
    hold.touch()
    repro = subprocess.Popen(
        ["dvc", "repro", "shard@2"],
        cwd=node,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        rwlock = node / ".dvc" / "tmp" / "rwlock"
        deadline = time.monotonic() + 120
        while "shard-2.txt" not in (rwlock.read_text() if rwlock.exists() else ""):
            assert repro.poll() is None and time.monotonic() < deadline, "repro did not start"
            time.sleep(0.2)
        journal = node / ".draftline" / "journal" / "generate" / "shard-3.jsonl"
        journal.parent.mkdir(parents=True)
        journal.write_text('{"journal": 1, "identity": {}}\n{"id": "a#0"}\n{"id": "a#1"}\n')
        (node / "scripts").mkdir()
        (node / "scripts" / "patch_server.sh").write_text("echo patched\n")

        done = salvage(node, env, "--no-push-git")
        assert done.returncode == 1
        assert "in flight: data/shards/shard-2.txt is being written by pid" in done.stdout
        assert "unfinished shard generate@3: 2 finished turns" in done.stdout
        assert "scripts/patch_server.sh" in done.stdout
        # What was finished is still saved.
        assert "SAFE      3 finished stages/files" in done.stdout
    finally:
        hold.unlink()
        repro.wait(timeout=120)
    assert repro.returncode == 0, repro.stdout.read() if repro.stdout else ""
    shutil.rmtree(node / "scripts")
    shutil.rmtree(journal.parent)
    done = salvage(node, env)
    assert done.returncode == 0, done.stdout
    assert "shard@2" in done.stdout


def test_endpoint_stopped_mid_push_then_second_salvage_succeeds(
    tmp_path: Path, env: dict[str, str]
) -> None:
    own = S3Server()  # this test stops its server: not the shared one
    own.start()
    try:
        own.create_bucket("midpush")
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY)
        origin = make_origin(tmp_path, env, bulk_files=20, bulk_kib=512)
        node = clone_node(origin, tmp_path / "node", env, own, "midpush", jobs=1)
        run(["dvc", "repro", "bulk"], node, env)

        stopped = threading.Event()

        def stop_after_some_uploads() -> None:
            while not stopped.is_set():
                if len(own.keys("midpush", "dvc/files/")) >= 3:
                    own.stop()
                    stopped.set()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=stop_after_some_uploads, daemon=True)
        watcher.start()
        first = salvage(node, env, "--no-push-git")
        stopped.set()
        watcher.join()
        assert first.returncode != 0, first.stdout
        assert "NOT SAFE" in first.stdout and "VERDICT: NOT SAFE" in first.stdout
        assert not own.running

        own.start()
        uploaded = len(own.keys("midpush", "dvc/files/"))
        assert 3 <= uploaded < 21  # 20 parts + the manifest: the push really was cut short
        second = salvage(node, env, "--no-push-git")
        assert "21 objects checked" in second.stdout, second.stdout
        assert "run-cache: 1 entries" in second.stdout
        # Only the git push is missing (no --push-git wanted): the data itself is safe.
        not_safe = [line for line in second.stdout.splitlines() if line.startswith("NOT SAFE")]
        assert not_safe == [line for line in not_safe if "only on this node" in line]
        assert len(own.keys("midpush", "dvc/files/")) == 21
    finally:
        own.stop()


def _in_mount_namespace(
    setup: str, cmd: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` after `setup` (mount commands) in a private mount namespace.

    Needs root or unprivileged user namespaces; the mounts vanish with the namespace.
    """
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--mount", "-r"]
    script = f'set -e\n{setup}\nexec "$@"\n'
    return subprocess.run(
        [*unshare, "sh", "-c", script, "sh", *cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_unwritable_cache_is_reported(node: Path, env: dict[str, str]) -> None:
    cache = node / ".dvc" / "cache"
    done = _in_mount_namespace(
        f"mount --bind {cache} {cache}\nmount -o remount,bind,ro {cache}",
        [sys.executable, "-m", "draftline", "salvage", "--no-push-git"],
        node,
        env,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"DVC cache {cache} is not writable (Read-only file system)" in done.stdout
    assert "dvc cache dir --local" in done.stdout


def test_full_disk_is_reported(node: Path, env: dict[str, str]) -> None:
    notes = node / "notes" / "salvage"
    notes.mkdir(parents=True)
    head = run(["git", "rev-parse", "HEAD"], node, env).stdout
    done = _in_mount_namespace(
        f"mount -t tmpfs -o size=64k tmpfs {notes}\n"
        f"dd if=/dev/zero of={notes}/filler bs=4k count=100 2>/dev/null || true",
        [sys.executable, "-m", "draftline", "salvage", "--no-push-git"],
        node,
        env,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"disk full: 0.0 MiB free at {notes}" in done.stdout
    assert "disk full while writing notes" in done.stdout
    assert "No space left on device" in done.stdout
    # The data itself still went to the remote.
    assert "SAFE      3 finished stages/files" in done.stdout
    # No notes, so no commit: the lock stays uncommitted and is reported as such.
    assert run(["git", "rev-parse", "HEAD"], node, env).stdout == head
    assert "dvc.lock" in done.stdout


def test_three_cases_safe_would_be_lost_and_never_here(
    node: Path, env: dict[str, str], server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A node that ran only the first stage (like curate), against a remote that holds a later
    stage's outputs from another node (shard@0) or lost them (shard@1): before the push its
    own output WOULD BE LOST, the others were NEVER HERE (in the remote or not), and after
    the push it is SAFE to shut down. Two nodes with real `dvc repro`, push and git: ~40 s."""
    # The other node finished prepare and two shards, pushed them and the lock.
    run(["dvc", "push", "-q", "-r", "s3"], node, env)
    run(["git", "add", "-A"], node, env)
    run(["git", "commit", "-qm", "two shards"], node, env)
    run(["git", "push", "-q", "origin", "main"], node, env)
    lost = {path: oid for oid, path in lock_objects(node).items()}["data/shards/shard-1.txt"]
    server.client().delete_object(Bucket=bucket, Key=remote_key(lost))

    here = clone_node(tmp_path / "origin.git", tmp_path / "node-b", env, server, bucket)
    prepare = here / "prepare.py"
    prepare.write_text(prepare.read_text().replace("range(6)", "range(7)"))
    run(["git", "commit", "-qam", "seven prompts per file"], here, env)
    run(["dvc", "repro", "prepare"], here, env)

    where = f"s3://{bucket}/dvc"
    before = salvage(here, env, "--dry-run")
    assert before.returncode == 1, before.stdout + before.stderr
    assert "VERDICT (dry run, nothing changed): NOT SAFE" in before.stdout
    lines = before.stdout.splitlines()
    assert f"WOULD BE LOST 1 stages/files not intact in {where}: prepare (" in before.stdout
    assert any(
        line.startswith(f"WOULD BE LOST missing in {where}: data/prepared (prepare,")
        and line.endswith("only on this node (in its DVC cache)")
        for line in lines
    )
    assert "          fix: run `draftline salvage`: it pushes it" in lines
    assert (
        f"NEVER HERE 1 stages/files named by dvc.lock never ran on this node; their outputs "
        f"are in {where}: shard@0" in lines
    )
    assert any(
        line.startswith("NEVER HERE 1 stages/files named by dvc.lock were never on this node and")
        and f"not (all) in {where} either: shard@1 (data/shards/shard-1.txt)" in line
        for line in lines
    )

    after = salvage(here, env)
    assert after.returncode == 0, after.stdout
    assert f"SAFE      1 finished stages/files in {where}: prepare (" in after.stdout
    assert f"their outputs are in {where}: shard@0" in after.stdout
    assert "either: shard@1" in after.stdout and "WOULD BE LOST" not in after.stdout
    assert "VERDICT: SAFE" in after.stdout


def test_refused_credentials_are_named_not_the_network(
    node: Path, env: dict[str, str], server: S3Server, bucket: str
) -> None:
    """moto enforcing IAM auth refuses keys that belong to no user (403): salvage says so,
    pushes nothing, and names the credentials as the fix."""
    from moto.core.authorization import enable_iam_authentication

    with enable_iam_authentication():
        done = salvage(node, env, "--no-push-git")
    assert done.returncode == 1
    assert (
        f"NOT SAFE  remote 's3': {server.endpoint} refused the credentials for bucket "
        f"'{bucket}' (HTTP 403)" in done.stdout
    )
    assert "export AWS_ACCESS_KEY_ID=" in done.stdout and "unreachable" not in done.stdout
    assert server.keys(bucket) == []
    no_secrets(done.stdout, done.stderr)


P_HF = "hf_PlantHfTok3nValue9x8y7z6w5v4u3t2s1"
P_SERVICE_CRED = "svc-cred-Plant-7781"
P_SHORT = "Zq7#k"
P_DB_URL_PW = "dbUrlPw-Plant-55"
P_ENDPOINT_PW = "EpPlant-9913"
P_HOOK = "HkPlantSecret8842Path"
P_API_KEY = "ak-Plant-3301"
P_DSN_KEY = "f00dPlantDsnKey4242"
P_CURL_PW = "CurlPlantPw-61"
P_GIT_PW = "GitPlantPw-77"
# The three that once reached the notes, then ten more shapes.
P_AUTH_TOKEN = "9c1e4b7a2f8d3e6c0b5a9f2e7d4c1b8a3f6e0d9c"  # `Authorization: Token <40 hex>`
P_PASS_SHORT = "Qx7pL"  # `pass=Qx7pL` in a run log
P_BARE_LOWER = "mqtwzoxkvbrhe"  # an innocently named variable's value, printed on its own
P_APIKEY_HDR = "k-9f8e7d6c5b4a"
P_NEGOTIATE = "YIIBhwYGKwYBBQUCoIIBezCC"
P_JSON_AUTH = "0a1b2c3d4e5f6a7b8c9d"
P_COOKIE = "zz9QpSessionPlant"
P_FRAGMENT = "tok-Plant-frag-771"
P_JSON_ESC = 'Mx"9\\q-plant'
P_PCT = "P@ss-w0rd!plant"
P_SHORT2 = "Tz4!w"
P_BARE_MIXED = "Rv8kPq2"
P_PW_SHORT = "Hq3z"
P_PCT_SIG = "Kd9/Wq+Zr=plant"


def everything_that_left(node: Path, tmp_path: Path, server: S3Server, bucket: str) -> list[str]:
    """Every git object of the node and of its origin, and every object in the bucket."""
    texts = []
    for repo in (node, tmp_path / "origin.git"):
        blobs = subprocess.run(
            ["git", "cat-file", "--batch-all-objects", "--batch"],
            cwd=repo,
            capture_output=True,
            check=True,
        ).stdout
        texts.append(blobs.decode("utf-8", errors="replace"))
    client = server.client()
    for key in server.keys(bucket):
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        texts.append(body.decode("utf-8", errors="replace"))
    return texts


def test_planted_secrets_leave_the_node_nowhere(
    node: Path, env: dict[str, str], server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Secrets planted the ways a real node holds them -- environment values with and
    without telling names, URLs with credentials (the project's own endpoint setting too),
    a webhook path, a 5-character password, a DSN key, curl `-u` lines in a server log, a
    JSON run log, a git remote with a password -- and printed in parts by logs. `doctor`,
    `salvage --dry-run` and `salvage` run; every git object (node and origin), every bucket
    object and all printed output hold none of them. Real dvc push and git: ~30 s."""
    env.update(
        HF_TOKEN=P_HF,
        MY_SERVICE_CRED=P_SERVICE_CRED,
        DB_PASS_SHORT=P_SHORT,
        DATABASE_URL=f"postgres://trainer:{P_DB_URL_PW}@db.internal:5432/runs",
        DRAFTLINE_SGLANG_ENDPOINTS=f"http://sgl:{P_ENDPOINT_PW}@127.0.0.1:30000",
        NOTIFY_URL=f"https://hooks.slack.com/services/T0PLANT1/B0PLANT2/{P_HOOK}",
        METRICS_URL=f"https://metrics.example/ingest?project=draftline&api_key={P_API_KEY}",
        SENTRY_DSN=f"https://{P_DSN_KEY}@o1.ingest.example/42",
        RUN_LABEL=P_BARE_LOWER,
        SMTP_PASSWORD=P_JSON_ESC,
        BROKER_URL=f"amqp://worker:{urllib.parse.quote(P_PCT, safe='')}@mq.internal/vhost",
        PGPASSWORD=P_SHORT2,
        EXTRA_ARG=P_BARE_MIXED,
        UPLOAD_SIG=P_PCT_SIG,
    )
    planted = [
        P_HF, P_SERVICE_CRED, P_SHORT, P_DB_URL_PW, P_ENDPOINT_PW, P_HOOK, P_API_KEY, P_DSN_KEY,
        P_CURL_PW, P_GIT_PW, ACCESS_KEY_ID, SECRET_ACCESS_KEY,
        P_AUTH_TOKEN, P_PASS_SHORT, P_BARE_LOWER, P_APIKEY_HDR, P_NEGOTIATE, P_JSON_AUTH,
        P_COOKIE, P_FRAGMENT, P_JSON_ESC, P_PCT, P_SHORT2, P_BARE_MIXED, P_PW_SHORT, P_PCT_SIG,
    ]  # fmt: skip
    mirror = f"https://deploy:{P_GIT_PW}@git.example/draftline.git"
    run(["git", "remote", "add", "mirror", mirror], node, env)
    (node / "logs" / "runs" / "generate").mkdir(parents=True)
    (node / "logs" / "train.log").write_text(
        f"connecting postgres://trainer:{P_DB_URL_PW}@db.internal:5432/runs\n"
        f"db password {P_DB_URL_PW}\nwebhook token {P_HOOK}\napi_key value {P_API_KEY}\n"
        f"service credential {P_SERVICE_CRED}\nshort password {P_SHORT}\n"
        f"sentry key {P_DSN_KEY}\nhf {P_HF}\naws {ACCESS_KEY_ID} {SECRET_ACCESS_KEY}\n"
        "step 10 loss=1.25 max_new_tokens=2048\n"
        f"run pass={P_PASS_SHORT} steps=3\n{P_BARE_LOWER}\nlabel {P_BARE_LOWER} done\n"
        f"GET https://app.example/cb#access_token={P_FRAGMENT}&state=1\n"
        f"smtp login {json.dumps({'pw': P_JSON_ESC})}\nbroker password {P_PCT}\n"
        f"pg {P_SHORT2}\nextra {P_BARE_MIXED}\npw: {P_PW_SHORT}\n"
        f"upload ?s={urllib.parse.quote(P_PCT_SIG, safe='')}\n"
    )
    server_log = node / ".draftline" / "sglang" / "server.out"
    server_log.parent.mkdir(parents=True)
    server_log.write_text(
        f"curl -u sgl:{P_ENDPOINT_PW} http://127.0.0.1:30000/health\n"
        f"curl --user admin:{P_CURL_PW} http://127.0.0.1:30000/flush_cache\n"
        f"> Authorization: Token {P_AUTH_TOKEN}\n> Authorization: ApiKey {P_APIKEY_HDR}\n"
        f"> Proxy-Authorization: Negotiate {P_NEGOTIATE}\n> Cookie: sessionid={P_COOKIE}\n"
    )
    (node / "logs" / "runs" / "generate" / "run.json").write_text(
        json.dumps(
            {
                "endpoint": f"http://sgl:{P_ENDPOINT_PW}@127.0.0.1:30000",
                "hf_token": P_HF,
                "db_password": P_SHORT,
                "note": f"api key {P_API_KEY} and {P_SERVICE_CRED}",
                "headers": {"authorization": f"Token {P_JSON_AUTH}"},
            }
        )
    )
    doctor = run([sys.executable, "-m", "draftline", "doctor"], node, env, check=False)
    dry = salvage(node, env, "--dry-run")
    done = salvage(node, env)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = [p.stdout + p.stderr for p in (doctor, dry, done)]
    left = everything_that_left(node, tmp_path, server, bucket)
    # The notes really went out: the logs, the run log and the snapshot are in origin.
    committed = left[1]
    assert "step 10 loss=1.25" in committed and "run.json" in committed
    assert "http://127.0.0.1:30000" in committed and "MY_SERVICE_CRED" in committed
    assert "curl --user admin:***" in committed and "draftline doctor" in printed[0]
    hits = [
        (secret, form)
        for secret in planted
        for form in {secret, urllib.parse.quote(secret, safe=""), json.dumps(secret)[1:-1]}
        for text in [*printed, *left]
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(form)}(?![A-Za-z0-9])", text)
    ]
    leaked = {secret for secret, _ in hits}
    print(f"planted {len(planted)} secrets; searched {len(printed) + len(left)} texts; "
          f"leaked {len(leaked)}: {sorted(leaked)}")  # fmt: skip
    assert hits == []
