"""A user's plain torch loop on several data-parallel ranks with ``StepRecorder`` (tests/test_attach_ranks.py)::

    python -m torch.distributed.run --nproc-per-node 2 tests/support/torch_ranks_loop.py OUT

tests/test_attach_torch.py's loop (docs/attach.md, "Any torch loop": the tiny DeepSeek-V3 initialised by
transformers from a seed, AdamW, clipping at 1.0, 2 steps of 2 global micro-batches) under torch's
``DistributedDataParallel`` on gloo: rank r trains the global micro-batches r, r + dp, ... (``rank_micro_batches``),
each its loss over its own count, ``no_sync`` but for the last; DDP averages the gradients over the ranks.
"""

import sys
from contextlib import nullcontext

import torch

from harness.attach.torch import StepRecorder
from harness.case.train_settings import rank_micro_batches
from tests.support.torch_loop import optimizer_of, tiny_model
from tests.support.train import TINY_MODEL

MICRO_BATCHES = 2


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = optimizer_of(model)
    recorder = StepRecorder(out, model, optimizer, TINY_MODEL, stated={"clip_grad": 1.0})
    data, vocab = torch.Generator().manual_seed(1), TINY_MODEL["vocab_size"]
    for step in (1, 2):
        batches = [(torch.randint(0, vocab, (1, 8), generator=data), torch.randint(0, vocab, (1, 8), generator=data))
                   for _ in range(MICRO_BATCHES)]
        mine = rank_micro_batches(MICRO_BATCHES, dp, rank)
        losses = []
        for i, mb in enumerate(mine):
            ids, labels = batches[mb]
            with nullcontext() if i == len(mine) - 1 else ddp.no_sync():
                logits = ddp(input_ids=ids, use_cache=False).logits
                loss = model.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=labels)
                (loss / len(mine)).backward()
            losses.append((loss / len(mine)).detach())
        grads = recorder.grads()
        norm, factor = recorder.clip_grad_norm_(model.parameters(), 1.0)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        recorder.record(step, losses, lr, grads, grad_norm=norm, clip_coeff=factor)
        optimizer.zero_grad()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
