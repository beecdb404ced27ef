"""One rank of the collectives check (``python -m harness reductions``), under torchrun: every message of the request
through all-reduce (sum), reduce-scatter (sum) and all-gather, on gloo (CPU) or NCCL (GPUs); its results written
to ``outputs.rank<r>.safetensors`` as ``<collective>.<dtype>.<size>``. The same code for both backends."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from harness.case.collectives import message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--request", type=Path, required=True)
    request = json.loads(parser.parse_args().request.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if request["backend"] == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(request["backend"])
    try:
        outputs = {}
        for dtype in request["dtypes"]:
            for size in request["sizes"]:
                sent = torch.from_numpy(message(request["seed"], rank, size, dtype).view(
                    "int16" if dtype == "bfloat16" else "float32")).view(getattr(torch, dtype)).to(device)
                reduced = sent.clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
                shard = torch.empty(size // world, dtype=sent.dtype, device=device)
                dist.reduce_scatter_tensor(shard, sent.clone(), op=dist.ReduceOp.SUM)
                gathered = torch.empty(size * world, dtype=sent.dtype, device=device)
                dist.all_gather_into_tensor(gathered, sent)
                for name, tensor in (("all_reduce", reduced), ("reduce_scatter", shard), ("all_gather", gathered)):
                    outputs[f"{name}.{dtype}.{size}"] = tensor.cpu()
        folder = Path(request["output_dir"])
        save_file(outputs, str(folder / f"outputs.rank{rank}.safetensors"))
        meta = {"rank": rank, "world": world, "backend": request["backend"], "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        (folder / f"meta.rank{rank}.json").write_text(json.dumps(meta))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
