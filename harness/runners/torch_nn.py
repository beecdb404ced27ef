"""Plain-PyTorch runner with Paddle's weight layout (``[in, out]``, NN GEMM); see ``harness.runners.torch``."""

from harness.run.protocol import serve
from harness.runners.torch import probe, runner
from harness.runners.torch_env import release

if __name__ == "__main__":
    serve("torch_nn", runner("nn"), probe, release)
