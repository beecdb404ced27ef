"""Digest throughput, side by side in one run (issue 33; docs/speed.md "Step digests where the tensors are").

    python docs/examples/speed/device_digest.py --device cpu --mb 100 --dtype float32     # the CPU figures
    python docs/examples/speed/device_digest.py --device cuda --mb 4096 --dtype bfloat16  # on the H200

On the CPU: XXH3-128 (the host path's digest), bits128v1 in numpy (the host reference) and in torch (one thread and
torch's default threads), each the best of --repeat on the same bytes. On a GPU: bits128v1 on the GPU (only the lane
sums come back), the runners' path (one Triton kernel where Triton imports) beside torch's elementwise ops, against
what a step file's digest cost before, the tensor copied to the host and hashed there with XXH3 (the copy and the
hash timed apart), and the GPU's digest checked against the numpy host reference of the host copy. Prints one line
per method and, with --json, writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, run from anywhere

from harness.run import bits128  # noqa: E402
from harness.runners.torch import digest as torch_digest  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def best(function, repeat: int, sync=lambda: None) -> tuple[float, object]:
    seconds, result = float("inf"), None
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        result = function()
        sync()
        seconds = min(seconds, time.perf_counter() - start)
    return seconds, result


def xxh3(raw) -> str:
    import xxhash

    return "xxh3_128:" + xxhash.xxh3_128(raw).hexdigest()


def on_cpu(tensor: torch.Tensor, repeat: int) -> list[dict]:
    array = tensor.view(torch.uint8).numpy()
    rows = []
    threads = torch.get_num_threads()
    methods = [("xxh3_128 (host path)", lambda: xxh3(array)),
               ("bits128v1 numpy (host reference)", lambda: bits128.digest_numpy(array)),
               (f"bits128v1 torch, {threads} threads", lambda: torch_digest.digest(tensor))]
    if threads > 1:
        def one_thread():
            torch.set_num_threads(1)
            try:
                return torch_digest.digest(tensor)
            finally:
                torch.set_num_threads(threads)
        methods.append(("bits128v1 torch, 1 thread", one_thread))
    digests = {}
    for name, function in methods:
        seconds, digests[name] = best(function, repeat)
        rows.append({"method": name, "seconds": seconds, "GB/s": tensor.nbytes / seconds / 1e9})
    bits = {d for n, d in digests.items() if "bits128v1" in n}
    assert len(bits) == 1, f"bits128v1 implementations disagree: {digests}"
    return rows


def on_gpu(tensor: torch.Tensor, repeat: int) -> list[dict]:
    sync = torch.cuda.synchronize
    rows, found = [], {}

    def ops():
        sums = torch_digest.lane_sums(tensor, chunk=torch_digest.CHUNK_WORDS["cuda"])
        return bits128.finish(sums.tolist(), tensor.nbytes)

    for name, function in ((f"{torch_digest.implementation(tensor.device)} (the runners' path)",
                            lambda: torch_digest.digest(tensor)),
                           ("bits128v1 in torch elementwise ops on the GPU", ops)):
        function()  # the first launch (a Triton kernel compiles here)
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        seconds, found[name] = best(function, repeat, sync)
        extra = torch.cuda.max_memory_allocated() - held
        rows.append({"method": name, "seconds": seconds, "GB/s": tensor.nbytes / seconds / 1e9,
                     "extra GPU memory GB": extra / 1e9})
    assert len(set(found.values())) == 1, f"the GPU's two paths disagree: {found}"
    many = list(torch.split(tensor.reshape(-1)[:3200 * 65536], 65536))  # a step's count of tensors, 128 KB each
    torch_digest.digests(many)
    seconds, _ = best(lambda: torch_digest.digests(many), repeat, sync)
    rows.append({"method": f"the runners' path, {len(many)} tensors of 128 KB in one call", "seconds": seconds,
                 "GB/s": sum(t.nbytes for t in many) / seconds / 1e9})
    device = next(iter(found.values()))
    copy_seconds, host = best(lambda: tensor.contiguous().cpu(), 1, sync)  # what host_bytes did, one tensor
    raw = host.view(torch.uint8).numpy()
    hash_seconds, _ = best(lambda: xxh3(raw), repeat)
    rows += [{"method": "before: copy to the host (tensor.contiguous().cpu())", "seconds": copy_seconds,
              "GB/s": tensor.nbytes / copy_seconds / 1e9},
             {"method": "before: XXH3-128 of the host copy, one thread", "seconds": hash_seconds,
              "GB/s": tensor.nbytes / hash_seconds / 1e9},
             {"method": "before: copy + XXH3 (one tensor; StepWriter ran 4 such threads)",
              "seconds": copy_seconds + hash_seconds, "GB/s": tensor.nbytes / (copy_seconds + hash_seconds) / 1e9}]
    start = time.perf_counter()
    reference = bits128.digest_numpy(raw)
    rows.append({"method": "bits128v1 numpy of the host copy (the check)", "seconds": time.perf_counter() - start,
                 "GB/s": tensor.nbytes / (time.perf_counter() - start) / 1e9})
    assert device == reference, f"the GPU's digest {device} is not the host reference's {reference}"
    assert device == torch_digest.digest(host), "the GPU's digest is not torch's on the CPU"
    print(f"GPU digest equals the host reference and torch on the CPU: {device}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mb", type=float, default=None, help="tensor size in MB (default: 4096 on a GPU, 100 here)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on a GPU, float32 here")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    mb = args.mb or (4096 if gpu else 100)
    dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    elements = int(mb * 1e6) // torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator(args.device).manual_seed(0)
    tensor = torch.randn(elements, dtype=dtype, device=args.device, generator=generator)
    where = torch.cuda.get_device_name() if gpu else \
        f"CPU, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads"
    print(f"{tensor.nbytes / 1e9:.3f} GB {str(dtype).removeprefix('torch.')} on {where}; torch {torch.__version__}; "
          f"best of {args.repeat}")
    rows = on_gpu(tensor, args.repeat) if gpu else on_cpu(tensor, args.repeat)
    for row in rows:
        extra = f"  (+{row['extra GPU memory GB']:.2f} GB on the GPU)" if "extra GPU memory GB" in row else ""
        print(f"{row['method']:<58} {row['seconds']:9.4f} s {row['GB/s']:9.2f} GB/s{extra}")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "bytes": tensor.nbytes, "dtype": str(dtype),
                                         "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
