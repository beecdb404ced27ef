"""``python -m harness.runners.torch_nn``: the plain-PyTorch runner with Paddle's weight layout (``[in, out]``,
NN GEMM); the code is ``torch/runner.py``'s."""

from harness.run.protocol import serve
from harness.runners.torch.env import cell_state, release
from harness.runners.torch.runner import probe, runner

if __name__ == "__main__":
    serve("torch_nn", runner("nn"), probe, release, cell_state)
