"""Test double, named as such: stands in for a real runner under the real launchers (torchrun,
paddle.distributed.launch) so the harness's handling of a failing rank can be tested. Never feeds a verdict.

``FAKE_RANK_FAILURE`` (read only here) says what rank 1 does: ``die`` (SIGKILL itself) or ``hang``; rank 0 waits
as if blocked in a collective with rank 1. With ``unsupported`` rank 0 says UNSUPPORTED (its meta.json, exit 3) and
rank 1 dies once it has. Every rank records its pid in ``fake_pids``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from harness.run.protocol import EXIT_UNSUPPORTED, META, rank_and_world, rank_file_name

request = json.loads(Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
rank, world = rank_and_world()
with open(Path(request["output_dir"]) / "fake_pids", "a") as pids:
    pids.write(f"{os.getpid()}\n")
failure = os.environ["FAKE_RANK_FAILURE"]
print(f"fake rank {rank} of {world} starts; rank 1 will {failure}", file=sys.stderr, flush=True)
if failure == "unsupported":
    meta = Path(request["output_dir"]) / rank_file_name(META, 0, world)
    if rank == 0:
        meta.write_text(json.dumps({"runner": "fake", "unsupported": "fake rank 0: no such kernel here"}))
        sys.exit(EXIT_UNSUPPORTED)
    deadline = time.monotonic() + 60
    while not meta.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("fake rank 1 dies after rank 0 said UNSUPPORTED", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1 and failure == "die":
    print("fake rank 1 dies: SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1:
    print("fake rank 1 hangs", file=sys.stderr, flush=True)
time.sleep(600)
