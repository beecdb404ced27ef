"""Attaching to the users' own training runs (docs/attach.md): a recorder that writes, after each optimizer step of
their loop, the step file the built-in training runners write (``harness.run.steps``: same names, format, digests and
meta), reading their state with the built-in runners' own readers, and hooks where their loops are.

This room sits with the runners (it runs in the user's process and imports their framework): nothing on the harness
side imports it. ``compare-runs`` reads what it writes (``harness.compare.captured_runs``).

- ``torch.py``: ``StepRecorder``, for any torch loop over an HF-named model (``harness.runners.torch.train_state``'s
  ``TorchStates``, the hf_model runner's reader, through the family's ``[hf.grads]`` name map).
- ``hf.py``: ``StepRecorderCallback``, an HF ``transformers.TrainerCallback`` (the HF ``Trainer``, hence ms-swift's),
  and ``attach(trainer, folder)``.
- ``paddle.py``: ``PaddleStepRecorder``, for a Paddle dygraph loop over a PaddleFormers model (paddle_model's readers);
  ``paddleformers.py``: its PaddleFormers ``TrainerCallback`` and ``attach(trainer, folder)``;
  ``paddle_optimizer.py``: what a Paddle optimizer does beyond its record (refused when the recorder is built).
- ``megatron.py``: ``MegatronStepRecorder``, the one call after ``optimizer.step()`` in a Megatron-Core loop
  (megatron_model's readers: ``MegatronStates``, ``step_outputs``).
"""
