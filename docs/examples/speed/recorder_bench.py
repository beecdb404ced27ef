"""The recorders at full width (issue 43): seconds per training step of a Megatron-Core loop with and without its
recorder (``MegatronStepRecorder``), and of the HF ``Trainer`` with and without its callback (``attach``), side by side
in one process, at ``kimi_k2_2layer_train_full``'s widths (docs/speed.md "Recorders at full width").

    python docs/examples/speed/recorder_bench.py --json OUT/recorder_bench.json          # on a GPU (~5 min)
    python docs/examples/speed/recorder_bench.py --tiny --json /tmp/recorder_bench.json  # on the CPU: it works

Each loop is the user's, as docs/attach.md has it: Megatron-LM's ``train_step`` (docs/examples/attach/megatron_loop.py:
DDP with fp32 gradient buffers, ``get_megatron_optimizer``'s bf16 optimizer with fp32 masters, the case's schedule and
clipping) and ``transformers.Trainer`` (``adamw_torch``, ``max_grad_norm``; on a GPU the usual mixed precision: fp32
parameters, ``bf16=True`` autocast; the recorder refuses a bf16 model without masters). Weights are random (the
timing does not depend on them); the data are the case's tokens in its micro-batches, random ids. Per loop: one
warm-up step, then ``--steps`` steps bare, ``--steps`` recorded (``steps_kept="none"`` and ``digest_on_device=True``:
every state tensor digested where it is, as at full width), ``--steps`` bare again; a step's seconds run from its
start to the device synchronised after it (the recorder's write included). The ratio is the recorded steps' median
over the bare steps' median (issue 43's goal: at most 1.2).

Widths: the case's. ``--experts`` and ``--vocab`` narrow the two counts that set the size without changing a layer's
widths: on a GPU of less than 120 GiB (an H100's 79 GiB cannot hold the case: issue 40) the default is 8 routed
experts of 32 (top-8 routing needs 8) and the case's vocabulary, 3.3 G parameters, about 22 bytes each on
Megatron's side at its peak (bf16 parameter, fp32 gradient, master and two moments, AdamW's temporary): the widest
configuration that fits, named in the output. ``--tiny``: ``kimi_k2_2layer_train_bf16``'s widths with 16 experts
on the CPU (its timings say nothing of a GPU's: on the CPU bits128v1 runs in torch's elementwise ops).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "examples" / "attach")]  # the repository, and the loop of the example

from harness.case.registry import Registry  # noqa: E402

FULL, TINY = "kimi_k2_2layer_train_full", "kimi_k2_2layer_train_bf16"
SMALL_GPU_GIB = 120  # below it the case does not fit (an H100: issue 40)
H100_EXPERTS = 8
TINY_EXPERTS = 16  # of the tiny case's 384: a step in seconds on 2 cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help=f"{TINY}'s widths, 16 experts, on the CPU (it works)")
    parser.add_argument("--experts", type=int, help="routed experts (default: the case's; 8 on a GPU under 120 GiB)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default: the case's)")
    parser.add_argument("--steps", type=int, default=3, help="steps a phase (bare, recorded, bare again)")
    parser.add_argument("--loops", default="megatron,hf", help="which loops, in order")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, help="profile one more recorded step of the Megatron loop: where its "
                                                     "time goes, Python (cProfile) and device (torch.profiler), here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    case = Registry.load().get(TINY if args.tiny else FULL)
    model, chosen = widths(case, device, args)
    result = {"case": case.name, "widths": chosen, "model": model, "tokens": case.tokens, "dtype": case.dtype,
              "micro_batches": case.train.micro_batches, "device": device_name(device), "steps": args.steps,
              "torch": torch.__version__, "loops": {}}
    print(json.dumps({k: v for k, v in result.items() if k != "loops"}), flush=True)
    for loop in args.loops.split(","):
        with tempfile.TemporaryDirectory(prefix="recorder_bench_") as folder:
            result["loops"][loop] = LOOPS[loop](case, model, device, args.steps, Path(folder), args.profile)
        free(device)
        print(summary(loop, result["loops"][loop]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))


def widths(case, device: torch.device, args) -> tuple[dict, str]:
    """The model config the loops train, and in words how it departs from the case's."""
    model = dict(case.config["model"])
    experts, vocab = args.experts, args.vocab
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    if experts is None and total is not None and total < SMALL_GPU_GIB:
        experts = H100_EXPERTS
    if experts is None and args.tiny:
        experts = TINY_EXPERTS
    changed = {key: value for key, value in (("n_routed_experts", experts), ("vocab_size", vocab))
               if value is not None and value != model[key]}
    words = ", ".join(f"{key} {value} (the case's {model[key]})" for key, value in changed.items())
    model.update(changed)
    gpu = f" on a GPU of {total:.0f} GiB" if total is not None else ""
    return model, f"{case.name}'s widths" + (f", but {words}{gpu}" if changed else "")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(case, model: dict, device: torch.device, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` micro-batches of the case's tokens: random ids and labels (one seed)."""
    generator = torch.Generator().manual_seed(case.seed)
    return [tuple(torch.randint(0, model["vocab_size"], (1, case.tokens), generator=generator).to(device)
                  for _ in range(2)) for _ in range(count)]


def timed_steps(run_step, device: torch.device, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        synchronize(device)
        start = time.perf_counter()
        run_step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def outcome(phases: dict, peak: float | None, recorded_folder: Path) -> dict:
    bare = statistics.median(phases["bare"] + phases["bare again"])
    recorded = statistics.median(phases["recorded"])
    meta = json.loads((recorded_folder / "meta.json").read_text())
    return {"seconds": phases, "bare_median": bare, "recorded_median": recorded, "ratio": recorded / bare,
            "recorded_steps": len(meta["capture"]["steps"]), "step_digests": meta["step_digests"],
            "steps_kept": meta["steps_kept"], "peak_gib": peak}


def summary(loop: str, measured: dict) -> str:
    per_phase = ", ".join(f"{name} {statistics.median(values):.3f}" for name, values in measured["seconds"].items())
    peak = f", peak {measured['peak_gib']:.1f} GiB" if measured["peak_gib"] is not None else ""
    return (f"{loop}: seconds per step (median) {per_phase}; recorded / bare {measured['ratio']:.3f} "
            f"({measured['recorded_steps']} steps recorded, {measured['step_digests']}){peak}")


# --- the Megatron-Core loop -------------------------------------------------------------------------------------------

def megatron(case, model: dict, device: torch.device, steps: int, folder: Path, profile: Path | None = None) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_loop import train_step

    from harness.attach.megatron import MegatronStepRecorder
    from harness.runners.megatron import model as megatron_model
    from harness.runners.megatron.train import CudaOnCpu

    train, dtype = case.train, torch.bfloat16
    adapted = CudaOnCpu if device.type == "cpu" else nullcontext
    megatron_model.init_process_group(device, gloo_groups=True)
    megatron_model.install_adapters(device, model)
    config, _ = megatron_model.translate_config(model, dtype, device)
    gpt = megatron_model.build_model(config, model, device)
    with torch.no_grad():  # built without initialisation (the runner loads a checkpoint): random weights here
        generator = torch.Generator(device).manual_seed(case.seed)
        for param in gpt.parameters():
            param.normal_(0.0, 0.02, generator=generator) if param.dim() > 1 else param.fill_(1.0)
    gpt.train()
    with adapted():
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
        config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
        own, _, _ = train.record.megatron(train.optimizer)  # optimizer="adam" and its betas and eps, as the runner
        optimizer = get_megatron_optimizer(OptimizerConfig(
            lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay, **own, clip_grad=train.clip_grad,
            bf16=True, params_dtype=dtype), [ddp])
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr, lr_warmup_steps=train.warmup_steps,
            lr_decay_steps=train.decay_steps, lr_decay_style=train.decay_style, start_wd=train.weight_decay,
            end_wd=train.weight_decay, wd_incr_steps=train.decay_steps, wd_incr_style="constant")
    data = batches(case, model, device, train.micro_batches)
    recorder = None

    def step():
        with adapted():
            losses = train_step([ddp], optimizer, scheduler, data)
        if recorder is not None:
            recorder.record(len(recorder.steps) + 1, losses)

    timed_steps(step, device, 1)  # warm-up: kernels chosen, the optimizer's state made
    phases = {"bare": timed_steps(step, device, steps)}
    recorder = MegatronStepRecorder(folder, [ddp], optimizer, model, steps_kept="none", digest_on_device=True,
                                    stated={"warmup_steps": train.warmup_steps, "decay_style": train.decay_style,
                                            "decay_steps": train.decay_steps})
    phases["recorded"] = timed_steps(step, device, steps)
    if profile is not None:
        profiled(step, device, profile)
    if recorder.stopped:
        raise RuntimeError(f"the recorder stopped: {recorder.stopped}")
    recorder.close()
    recorder = None
    phases["bare again"] = timed_steps(step, device, steps)
    measured = outcome(phases, peak_gib(device), folder)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return measured


# --- the HF Trainer ---------------------------------------------------------------------------------------------------

class StepClock(TrainerCallback):
    """A TrainerCallback timing each step from its start to the device synchronised at its end (the Trainer's own
    events; the recorder's callback, added after it, writes inside that span)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.start = device, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self.start)


def profiled(step, device: torch.device, out: Path) -> None:
    """One recorded step under cProfile (the Python: cumulative seconds per function) and one under torch.profiler
    (each op's and kernel's own time), written to `out` as text."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    python = cProfile.Profile()
    python.runcall(timed_steps, step, device, 1)
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(60)
    (out / "megatron_recorded_step.cprofile.txt").write_text(text.getvalue())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as torch_profile:
        timed_steps(step, device, 1)
    averages = torch_profile.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=40))
    (out / "megatron_recorded_step.torch_profile.txt").write_text("\n\n".join(tables))


def hf(case, model: dict, device: torch.device, steps: int, folder: Path, profile: Path | None = None) -> dict:
    train = case.train
    data = [{"input_ids": ids[0], "labels": labels[0]} for ids, labels in batches(case, model, device,
                                                                                  train.micro_batches * (1 + steps))]
    phases, peaks = {}, []
    for phase, recorded in (("bare", False), ("recorded", True), ("bare again", False)):
        phases[phase] = trainer_steps(case, model, device, steps, data, folder / phase.replace(" ", "_"),
                                      folder / "recorded" if recorded else None)
        peaks.append(peak_gib(device))
        free(device)  # the phase's model, Trainer and optimizer state (reference cycles) gone before the next
    return outcome(phases, max(peaks) if device.type == "cuda" else None, folder / "recorded")


def trainer_steps(case, model: dict, device: torch.device, steps: int, data: list, output: Path,
                  recorded: Path | None) -> list[float]:
    """A fresh model (the same seed) trained 1 + `steps` steps by a Trainer, recorded into `recorded` where given:
    the seconds of the steps after the first (each Trainer makes its optimizer's state anew)."""
    from transformers import Trainer, TrainingArguments

    from harness.attach.hf import attach
    from harness.families import model_config
    from harness.runners.torch.hf_families import hf_config, modeling

    typed, train = model_config(model), case.train
    torch.manual_seed(case.seed)
    with torch.device(device):
        causal_lm = modeling(typed).DeepseekV3ForCausalLM(hf_config(typed, modeling(typed)))
    causal_lm.train()
    arguments = TrainingArguments(
        output_dir=str(output), use_cpu=device.type == "cpu", bf16=device.type == "cuda",
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=1, gradient_accumulation_steps=train.micro_batches, max_steps=1 + steps,
        train_sampling_strategy="sequential", dataloader_num_workers=0, dataloader_pin_memory=False,
        optim="adamw_torch", learning_rate=train.lr, weight_decay=train.weight_decay,
        adam_beta1=train.optimizer.betas[0], adam_beta2=train.optimizer.betas[1], adam_epsilon=train.optimizer.eps,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": train.min_lr},
        warmup_steps=train.warmup_steps, max_grad_norm=train.clip_grad)
    clock = StepClock(device)
    trainer = Trainer(model=causal_lm, args=arguments, train_dataset=data, callbacks=[clock])
    callback = attach(trainer, recorded, model_config=model, steps_kept="none",
                      digest_on_device=True) if recorded else None
    trainer.train()
    if callback is not None and callback.recorder.stopped:
        raise RuntimeError(f"the recorder stopped: {callback.recorder.stopped}")
    return clock.seconds[1:]


LOOPS = {"megatron": megatron, "hf": hf}

if __name__ == "__main__":
    main()
