"""A GPU run's steps that keep digests only: the state after a step digested on a CUDA stream of its own while the
next step's forward and backward run, its step file written just before that step's optimizer changes the state.

Why: at Kimi-K2's widths the digests of a step's state (parameters, masters, both moments: about 59 GB at 8 experts)
take 35.6 ms of an H100 against a 0.181 s bare step, 1.20x by themselves (docs/speed.md), while the step leaves the
GPU idle much of its time (launches, Python). The digests read the state; nothing changes it until the next
``optimizer.step()``, a planted flip or a re-feed's load, each of which calls ``flush()`` first, except what the next
step's backward updates in place (Megatron's routing biases): the caller names those (`moving`), copied before.
At most one step is in flight; a kept step, a CPU run or a host-digest run is written at once, as before.
"""

from __future__ import annotations

import torch

from harness.runners.torch.digest import Digested, digest_now


class OverlappedWrites:
    def __init__(self, writer, device: torch.device):
        self.writer = writer
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and writer.digests is not None else None
        self.pending: tuple | None = None

    def write(self, step: int, scalars: dict, tensors: dict, pieces: dict | None = None, doubles: dict | None = None,
              moving: frozenset = frozenset()) -> None:
        """``StepWriter.write``'s arguments; `moving`: names of `tensors` the next step changes before its update."""
        self.flush()
        if self.stream is None or step in self.writer.kept:
            self.writer.write(step, scalars, tensors, pieces, doubles)
            return
        tensors = {name: t.clone() if name in moving else t for name, t in tensors.items()}
        spans = [(name, start, end, t) for name, held in (pieces or {}).items() for start, end, t in held]
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the step's work, queued before
            fresh = {name: t for name, t in tensors.items() if not isinstance(t, Digested)}
            fresh.update({(name, start): t for name, start, _, t in spans if not isinstance(t, Digested)})
            made = digest_now(fresh)
        placed: dict[str, list] = {}
        for name, start, end, t in spans:
            placed.setdefault(name, []).append((start, end, made.get((name, start), t)))
        self.pending = (step, scalars, {name: made.get(name, t) for name, t in tensors.items()}, placed, doubles,
                        (tensors, pieces))  # the last: the tensors themselves, alive until their digests are made

    def flush(self) -> None:
        """Write the step in flight, if any (the host waits for its digests only, not for the work queued since),
        and order what comes next on the step's stream after them."""
        if self.pending is None:
            return
        step, scalars, tensors, pieces, doubles, _ = self.pending
        with torch.cuda.stream(self.stream):
            self.writer.write(step, scalars, tensors, pieces, doubles)
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.pending = None
