"""``python -m harness.runners.paddle_model``: a whole model, PaddleFleet's GPTModel (GPU) or PaddleFormers' model of
a family (CPU; harness/runners/paddle/families.py): one forward and backward (op ``causal_lm``, ``paddle/model.py``)
or N optimizer steps with Paddle's AdamW or Momentum (op ``causal_lm_train``, ``paddle/train.py``)."""

from harness.run.protocol import Phases, Unsupported, import_answer, import_failure, model_op_table, serve


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.paddle import model, train

    return (train.run if request["op"] == "causal_lm_train" else model.run)(request, phases)


def probe(device: str) -> dict:
    """What would run here (``--probe``): Paddle, then the model a run builds on this device (PaddleFormers' on the
    CPU, with the dtypes its kernels allow; PaddleFleet's on a GPU), imported as a run imports it."""
    from harness.runners.paddle import model

    if model.paddle is None:
        return import_answer("paddle", model.PADDLE_IMPORT_ERROR)
    paddle = model.paddle
    answer = {"framework": "paddle", "versions": {"paddlepaddle": paddle.__version__},
              "compiled_with_cuda": paddle.is_compiled_with_cuda()}
    if device == "gpu":
        try:
            import paddlefleet  # noqa: F401
        except Exception as error:  # noqa: BLE001
            failure = import_failure("paddlefleet", error)
            if not isinstance(failure, Unsupported):
                return {**answer, **import_answer("paddlefleet", error)}
            why = {"would_run": None, "reason": f"{failure}: on a GPU the Paddle side is PaddleFleet's GPTModel"}
            return {**answer, "importable": True, "ops": model_op_table("paddle_model", {
                "causal_lm": why, "causal_lm_train": {"would_run": None, "reason": "training on a GPU: not written"}})}
        return {**answer, "importable": True, "ops": model_op_table("paddle_model", {
            "causal_lm": "paddlefleet GPTModel", "causal_lm_train": {
                "would_run": None, "reason": "training on a GPU: PaddleFleet's loop is not written"}})}
    from harness.families import FAMILIES
    from harness.runners.paddle import families, paddlefleet_ops_shim

    models, missing = [], []  # a family PaddleFormers has no dygraph model of is UNSUPPORTED, not a broken runner
    try:
        paddlefleet_ops_shim.install()
        import paddleformers
        for name, family in FAMILIES.items():
            m = family.config()  # the family's real config: which classes its runs import
            try:
                families.classes(m)
                models.append(families.model_name(m))
            except Unsupported as why:
                missing.append(f"{name}: UNSUPPORTED, {why}")
    except Exception as error:  # noqa: BLE001
        return {**answer, **import_answer("paddleformers", error)}
    answer["versions"]["paddleformers"] = getattr(paddleformers, "__version__", "unknown")
    formers = ", ".join(models) + " (Paddle dygraph, CPU)"
    if missing:
        answer["families_unsupported"] = missing
    try:
        paddle.set_device("cpu")
        model._probe_cpu_bf16_matmul()
        bf16 = {"would_run": formers}
    except Unsupported as missing:  # every linear needs it, in a step and in training alike
        bf16 = {"would_run": None, "reason": str(missing)}
    return {**answer, "importable": True, "ops": model_op_table("paddle_model", {
        "causal_lm": {"bfloat16": bf16, "float32": {"would_run": formers}},
        "causal_lm_train": {"bfloat16": bf16,
                            "float32": {"would_run": formers + " + paddle.optimizer.AdamW or Momentum"}}})}


if __name__ == "__main__":
    # the Paddle runner's: they guard a missing paddle the same way
    from harness.runners.paddle.runner import cell_state, release

    serve("paddle_model", run, probe, reset=release, cell_state=cell_state)
