"""Test double, named as such: stands in for a real runner under the real launchers (torchrun,
paddle.distributed.launch) so the harness's handling of a failing rank can be tested. Never feeds a verdict.

``FAKE_RANK_FAILURE`` (read only here) says what rank 1 does: ``die`` (SIGKILL itself) or ``hang``.
Rank 0 waits as if blocked in a collective with rank 1. Every rank records its pid in ``fake_pids``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from harness.run.protocol import rank_and_world

request = json.loads(Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
rank, world = rank_and_world()
with open(Path(request["output_dir"]) / "fake_pids", "a") as pids:
    pids.write(f"{os.getpid()}\n")
failure = os.environ["FAKE_RANK_FAILURE"]
print(f"fake rank {rank} of {world} starts; rank 1 will {failure}", file=sys.stderr, flush=True)
if rank == 1 and failure == "die":
    print("fake rank 1 dies: SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1:
    print("fake rank 1 hangs", file=sys.stderr, flush=True)
time.sleep(600)
