"""``python -m harness.runners.paddle_model``: a whole model, PaddleFleet's GPTModel (GPU) or PaddleFormers'
DeepseekV3 (CPU): one forward and backward (op ``causal_lm``, ``paddle/model.py``) or N optimizer steps with Paddle's
AdamW (op ``causal_lm_train``, ``paddle/train.py``)."""

from harness.run.protocol import Phases, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.paddle import model, train

    return (train.run if request["op"] == "causal_lm_train" else model.run)(request, phases)


if __name__ == "__main__":
    # the Paddle runner's: they guard a missing paddle the same way
    from harness.runners.paddle.runner import cell_state, release

    serve("paddle_model", run, reset=release, cell_state=cell_state)
