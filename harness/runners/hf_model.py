"""``python -m harness.runners.hf_model``: HF transformers' model of a family (``torch/hf_families.py``), a whole
model: one forward and backward (op ``causal_lm``, ``torch/hf_model.py``) or N optimizer steps with the case's torch
optimizer, AdamW or SGD (op ``causal_lm_train``, ``torch/hf_train.py``)."""

from harness.run.protocol import Phases, import_answer, model_op_table, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.torch import fla_refusal, hf_model, hf_train

    with fla_refusal.refusal_as_unsupported():  # fla refusing the Triton on Hopper: a package missing
        return (hf_train.run if request["op"] == "causal_lm_train" else hf_model.run)(request, phases)


def probe(device: str) -> dict:
    """What would run here (``--probe``): torch and transformers imported as a run imports them, the model class."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - not installed, or broken: the doctor says which
        return import_answer("torch", error)
    answer = {"framework": "pytorch", "versions": {"torch": torch.__version__},
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cuda_available": torch.cuda.is_available()}
    if device == "gpu" and not torch.cuda.is_available():
        answer["device_problem"] = f"torch {torch.__version__} sees no GPU"
    from harness import environments
    from harness.families import FAMILIES

    # the families whose HF side runs in this interpreter; the others' run in the environment their hf.toml names
    here = {name: f for name, f in FAMILIES.items() if environments.of_family(f) == environments.active()}
    try:
        import transformers

        from harness.runners.torch import hf_families
        defaults = [family.config() for family in here.values()]
        model = ", ".join(f"{hf_families.modeling(m).__name__}.{hf_families.model_class(m)}" for m in defaults)
    except Exception as error:  # noqa: BLE001
        return {**answer, **import_answer("transformers", error)}
    answer["versions"]["transformers"] = transformers.__version__
    answer["families_elsewhere"] = [f"{name}: in the environment {environments.of_family(f)!r}"
                                    for name, f in FAMILIES.items() if name not in here]
    return {**answer, "importable": True, "ops": model_op_table("hf_model", {
        "causal_lm": model, "causal_lm_train": f"{model} + torch.optim.AdamW or SGD + clip_grad_norm_ + "
                                               "transformers' LambdaLR schedule"})}


if __name__ == "__main__":
    from harness.runners.torch import env

    serve("hf_model", run, probe, reset=env.release, cell_state=env.cell_state)
