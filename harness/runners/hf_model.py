"""``python -m harness.runners.hf_model``: HF transformers' DeepseekV3, a whole model: one forward and backward (op
``causal_lm``, ``torch/hf_model.py``) or N optimizer steps with torch's AdamW (op ``causal_lm_train``,
``torch/hf_train.py``)."""

from harness.run.protocol import Phases, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.torch import hf_model, hf_train

    return (hf_train.run if request["op"] == "causal_lm_train" else hf_model.run)(request, phases)


if __name__ == "__main__":
    from harness.runners.torch import env

    serve("hf_model", run, reset=env.release, cell_state=env.cell_state)
