"""``python -m harness.runners.hf_model``: HF transformers' DeepseekV3, a whole model (op ``causal_lm``); the code is
``harness.runners.torch.hf_model``."""

if __name__ == "__main__":
    from harness.runners.torch.hf_model import main

    main()
