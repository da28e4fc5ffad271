"""Wall time of a run trained while it is generated (two nodes) against the same run done in
sequence (one node, `dvc repro`), measured in the same session on this machine.

The nodes are clones of this project on one machine (tests/helpers/two_node_run.py): a bare git
origin, moto's S3 server on 127.0.0.1 as the DVC remote, `draftline lead` in one clone and
`draftline follow` in the other, against plain `dvc repro` in a third. Both runs must give the
same drafter bit for bit (the script fails otherwise). On one machine the two "nodes" share its
cores, so the ratio here understates what two real nodes gain; it shows what the overlap and
the per-shard pushes cost or save.

    python benchmarks/train_while_generate.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import two_node_run as two  # noqa: E402
from helpers.s3_server import S3Server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--poll-s", type=float, default=1.0, help="follower's poll interval")
    args = parser.parse_args()

    server = S3Server()
    server.start()
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            origin, env, bucket = two.setup(tmp, server)
            reference, sequential_s = two.sequential(
                origin, tmp / "sequential", env, server, bucket
            )
            print(f"sequential (one node, dvc repro): {sequential_s:.0f} s")

            bucket2 = f"{bucket}-b"  # a fresh remote: nothing pushed by the reference run
            server.create_bucket(bucket2)
            gen = two.clone(origin, tmp / "gen", env, server, bucket2)
            train = two.clone(origin, tmp / "train", env, server, bucket2)
            began, began_wall = time.monotonic(), time.time()  # events carry wall-clock times
            lead = two.start(gen, env, "lead", "--run", two.RUN, log="lead.log")
            follow = two.start(
                train, env, "follow", "--run", two.RUN, "--poll-s", str(args.poll_s),
                log="follow.log",
            )  # fmt: skip
            two.finish(lead, gen, "lead.log", timeout=3600)
            generator_s = time.monotonic() - began
            two.finish(follow, train, "follow.log", timeout=3600)
            overlapped_s = time.monotonic() - began
            print(
                f"two nodes: generator done after {generator_s:.0f} s, drafter after "
                f"{overlapped_s:.0f} s"
            )
            same = two.digest(train / "models/drafter") == two.digest(reference / "models/drafter")
            same_lock = two.lock_stages(train) == two.lock_stages(reference)
            links = [e for e in two.events(train, "train") if e["stage"].startswith("train_shard")]
            first_link = min(e["start"] for e in links) - began_wall
    finally:
        server.stop()
    ratio = overlapped_s / sequential_s
    print(
        f"overlapped / sequential wall time: {ratio:.2f}; first link trained "
        f"{first_link:.0f} s after the start; same drafter: {same}; same dvc.lock: {same_lock}"
    )
    figures = {
        "sequential_s": round(sequential_s, 1),
        "overlapped_s": round(overlapped_s, 1),
        "generator_done_s": round(generator_s, 1),
        "first_link_start_s": round(first_link, 1),
        "training_after_generation_s": round(overlapped_s - generator_s, 1),
        "ratio_overlapped_over_sequential": round(ratio, 3),
        "same_drafter": same,
        "same_lock": same_lock,
        "cores": __import__("os").cpu_count(),
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if same and same_lock else 1


if __name__ == "__main__":
    raise SystemExit(main())
