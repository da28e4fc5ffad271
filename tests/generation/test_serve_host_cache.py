"""The hierarchical cache's host pool is sized from the memory the node lets its engines use:
the smaller of physical RAM and the cgroup limit, as SGLang bounds it.

The cgroup is read from files laid out as the kernel shows them (`/proc/self/cgroup`,
`/proc/self/mountinfo`, the cgroup folders under their mount), written into a temporary folder
that stands in for `/`; RAM is passed in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from draftline.generation import host_cache
from draftline.runtime import params

REPO = Path(__file__).resolve().parents[2]

GB = 10**9
B200 = {"hierarchical_cache": True, "dp_size": 8, "tp_size": 1, "host_cache_share_of_ram": 0.5}
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNT = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"


def fake_root(tmp: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A folder laid out like `/` for what the cgroup lookup reads."""
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/cgroup").write_text(cgroup, encoding="utf-8")
    (tmp / "proc/self/mountinfo").write_text(mountinfo, encoding="utf-8")
    for path, text in files.items():
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text, encoding="utf-8")
    return tmp


def test_v2_the_tightest_limit_of_the_process_cgroup_and_its_parents(tmp_path):
    """cgroup v2: the job's own memory.max, its parent's memory.high (SGLang honours both),
    the root without limit files: the tightest wins and is named."""
    root = fake_root(
        tmp_path,
        "0::/system.slice/job.scope\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/system.slice/job.scope/memory.max": f"{900 * GB}\n",
            "sys/fs/cgroup/system.slice/job.scope/memory.high": "max\n",
            "sys/fs/cgroup/system.slice/memory.max": "max\n",
            "sys/fs/cgroup/system.slice/memory.high": f"{640 * GB}\n",
        },
    )
    assert host_cache.cgroup_limit(root) == (640 * GB, "/sys/fs/cgroup/system.slice/memory.high")
    memory = host_cache.node_memory(2_000 * GB, root)
    assert memory == host_cache.Memory(640 * GB, "cgroup /sys/fs/cgroup/system.slice/memory.high")
    # 0.5 of 640 GB over 8 engines, not of the node's 2 TB (125 GB each).
    assert host_cache.host_cache_gb(B200, 2_000 * GB, root) == 40
    line = host_cache.describe(B200, 2_000 * GB, root)
    assert line == (
        "--hicache-size 40 GB per engine, 320 GB in all (0.5 of 640 GB (the cgroup "
        "/sys/fs/cgroup/system.slice/memory.high limit, below RAM) / 8 ranks)"
    )


def test_v1_container_that_shows_its_own_cgroup_at_the_mount(tmp_path):
    """cgroup v1 in a container: /proc names the host's path (/docker/<id>), which does not
    exist under the container's mount; the mount itself is the container's cgroup."""
    root = fake_root(
        tmp_path,
        "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        V1_MOUNT,
        {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{1_117 * GB}\n"},
    )
    assert host_cache.cgroup_limit(root) == (
        1_117 * GB,
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    )
    assert host_cache.host_cache_gb(B200, 2_015 * GB, root) == 69  # 0.5 x 1,117 / 8


@pytest.mark.parametrize(
    ("limit", "ram_gb", "expected"),
    [
        ("9223372036854771712", 2_000, "RAM"),  # v1's "no limit"
        (str(4_000 * GB), 2_000, "RAM"),  # a limit above RAM bounds nothing
    ],
)
def test_no_limit_below_ram_leaves_ram_the_bound(tmp_path, limit, ram_gb, expected):
    root = fake_root(
        tmp_path,
        "4:memory:/slurm/job_7\n",
        V1_MOUNT,
        {"sys/fs/cgroup/memory/slurm/job_7/memory.limit_in_bytes": limit + "\n"},
    )
    memory = host_cache.node_memory(ram_gb * GB, root)
    assert memory is not None and memory.source == expected and memory.bytes == ram_gb * GB
    assert host_cache.host_cache_gb(B200, ram_gb * GB, root) == 125 * ram_gb // 2_000
    assert "(RAM) / 8 ranks" in host_cache.describe(B200, ram_gb * GB, root)


def test_no_cgroup_files_at_all(tmp_path):
    """A machine without /proc's cgroup files (not Linux): RAM alone."""
    assert host_cache.cgroup_limit(tmp_path) is None
    assert host_cache.node_memory(256 * GB, tmp_path) == host_cache.Memory(256 * GB, "RAM")


def test_serve_start_and_doctor_use_the_bound(tmp_path, monkeypatch):
    """The command `serve start` launches and the row `draftline doctor` prints both read the
    node's memory through `node_memory`; here it reads the fake v2 tree instead of `/`, on a
    node of 2 TB RAM."""
    from draftline.commands import doctor
    from draftline.generation.sglang_server import server_command

    root = fake_root(
        tmp_path,
        "0::/job\n",
        V2_MOUNT,
        {"sys/fs/cgroup/job/memory.max": f"{800 * GB}\n"},
    )
    real = host_cache.node_memory
    monkeypatch.setattr(host_cache, "node_memory", lambda *_: real(2_000 * GB, root))
    profile = {"name": "b200x8", "sglang": {**B200, "port": 30000}}
    command = server_command(profile, {"path": "Qwen/Qwen3.6-27B", "revision": "main"}, python="p")
    assert command[command.index("--hicache-size") + 1] == "50"  # 0.5 x 800 GB / 8
    (row,) = doctor._host_cache_rows({"hardware": profile})
    assert "--hicache-size 50 GB per engine" in row[2]
    assert "cgroup /sys/fs/cgroup/job/memory.max limit, below RAM" in row[2]


def test_doctor_shows_the_running_requests_sglang_gives_the_model():
    from draftline.commands import doctor

    composed = params.compose(["model=qwen3_6_27b", "hardware=pro6000x4"], REPO / "conf")
    rows = doctor._host_cache_rows(composed)
    running = [row for row in rows if row[0] == "running requests (pro6000x4)"]
    assert running and running[0][1] is True
    assert running[0][2].startswith("18 per engine x 4 (bound by the Gated DeltaNet state pool")
