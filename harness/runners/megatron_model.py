"""``python -m harness.runners.megatron_model``: Megatron-Core's GPTModel, a whole model: one forward and backward
(op ``causal_lm``, ``megatron/model.py``) or N optimizer steps in Megatron's own training code (op
``causal_lm_train``, ``megatron/train.py``)."""

from harness.run.protocol import Phases, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.megatron import model, train

    return (train.run if request["op"] == "causal_lm_train" else model.run)(request, phases)


if __name__ == "__main__":
    from harness.runners.megatron.runner import cell_state, reset

    serve("megatron_model", run, reset=reset, cell_state=cell_state)
