"""``python -m harness.runners.paddle_model``: a whole model (op ``causal_lm``), PaddleFleet's GPTModel or
PaddleFormers' DeepseekV3; the code is ``harness.runners.paddle.model``."""

if __name__ == "__main__":
    from harness.runners.paddle.model import main

    main()
