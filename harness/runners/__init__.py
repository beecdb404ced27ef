"""Runner subprocesses, one room per framework: ``python -m harness.runners.<name> --request FILE``.

A runner imports only its own framework (plus the framework-free ``harness.run.protocol`` and the op records of
``harness.case``), reads the request and the checkpoint, runs the op (or the whole model) forward and backward, and
writes ``outputs.safetensors`` (canonical names and layout) and ``meta.json`` into the request's output folder.

| runner name      | room        | what runs                                                            |
|------------------|-------------|----------------------------------------------------------------------|
| ``megatron``       | ``megatron/`` | Megatron-Core's own layers per op (``ops.py``), no Transformer Engine |
| ``megatron_model`` | ``megatron/`` | Megatron-Core ``GPTModel``, local spec, a family's model (``model.py``) |
| ``paddle``         | ``paddle/``   | PaddleFleet, else PaddleFormers, else the recipe (``levels.py``)       |
| ``paddle_model``   | ``paddle/``   | PaddleFleet's ``GPTModel`` or PaddleFormers' model (``model.py``)      |
| ``torch``, ``torch_nn`` | ``torch/`` | plain PyTorch ops (``runner.py``); ``torch_nn`` in Paddle's layout   |
| ``hf_model``       | ``torch/``    | HF transformers' model of the family (``hf_model.py``)                 |
| ``oracle``         | ``oracle/``   | the truth: numpy float64, rounded once (``runner.py``, ``exact.py``)   |

Each room's ``__init__`` says what it adapts to run where it otherwise cannot. The op-level runner of a room is its
``__main__``; ``megatron_model.py``, ``paddle_model.py``, ``hf_model.py`` and ``torch_nn.py`` here are only entry
points, so every runner keeps the command line ``python -m harness.runners.<name>``. The model runners build a model
family's model through its builder for their stack (``harness/families/<family>/<stack>.py``: DeepSeek-V3 /
Kimi-K2, GLM-4.5 MoE).
"""
