"""``python -m harness.runners.megatron_model``: Megatron-Core's GPTModel, a whole model (op ``causal_lm``); the code is
``harness.runners.megatron.model``."""

if __name__ == "__main__":
    from harness.runners.megatron.model import main

    main()
