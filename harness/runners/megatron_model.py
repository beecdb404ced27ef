"""``python -m harness.runners.megatron_model``: Megatron-Core's GPTModel, a whole model: one forward and backward
(op ``causal_lm``, ``megatron/model.py``) or N optimizer steps in Megatron's own training code (op
``causal_lm_train``, ``megatron/train.py``)."""

from harness.run.protocol import Phases, import_answer, model_op_table, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.megatron import model, train

    return (train.run if request["op"] == "causal_lm_train" else model.run)(request, phases)


def probe(device: str) -> dict:
    """What would run here (``--probe``): the op runner's answer (torch, Megatron-Core, the CPU or GPU), then the
    model and training pieces imported as a run imports them."""
    from harness.runners.megatron import runner

    answer = runner.probe(device)
    if not answer.get("importable"):
        return answer
    try:
        from harness.runners.megatron import model, train  # noqa: F401 - GPTModel, the optimizer, DDP, the scheduler
    except Exception as error:  # noqa: BLE001 - a model piece that does not import: the doctor says which
        return {**answer, **import_answer("megatron.core.models.gpt", error)}
    return {**answer, "ops": model_op_table("megatron_model", {
        "causal_lm": "megatron.core GPTModel (local spec, no Transformer Engine)",
        "causal_lm_train": "GPTModel + DistributedDataParallel + get_megatron_optimizer + OptimizerParamScheduler"})}


if __name__ == "__main__":
    from harness.runners.megatron.runner import cell_state, reset

    serve("megatron_model", run, probe, reset=reset, cell_state=cell_state)
