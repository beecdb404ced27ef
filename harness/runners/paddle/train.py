"""paddle_model's training runner (op ``causal_lm_train``, docs/training.md): N optimizer steps of the case's model
family in PaddleFormers (the model of ``harness.runners.paddle.model``, the class ``harness.runners.paddle.families``
names, CPU, float32) with Paddle's own training pieces, every per-step quantity written in canonical names through
the family's ``[paddle.grads]`` rules (read and, for the re-feed and the negative control, written back: a fused
tensor's part, q, k or v of ``qkv_proj``, is its columns there).

- the optimizer the case names, built by its record (``harness.optimizers``): ``paddle.optimizer.AdamW`` or
  ``paddle.optimizer.Momentum`` (``multi_precision`` off: float32 parameters have no masters), weight decay on every
  parameter unless the case says ``not_1d`` (then the record's way leaves the 1-D ones out: AdamW's
  ``apply_decay_param_fun``, Momentum's per-parameter ``L2Decay(0.0)``); its state is read from the optimizer's
  accumulators the record names;
- ``paddle.nn.ClipGradByGlobalNorm`` as the optimizer's ``grad_clip`` (clip_norm / max(norm, clip_norm), no 1e-6);
- ``paddle.optimizer.lr``: ``LinearWarmup`` (from 0) around ``CosineAnnealingDecay`` (which LinearWarmup steps with
  an explicit epoch: its closed form), the bare ``CosineAnnealingDecay`` without warmup (its recursive form), or a
  constant; ``scheduler.step()`` after every optimizer step;
- per micro-batch ``(loss / micro_batches).backward()`` (PaddleFormers' Trainer's gradient accumulation), gradients
  accumulating in ``param.grad``; then ``optimizer.step()``, ``optimizer.clear_grad()``.

On several data-parallel ranks (``train.dp``, docs/training-ranks.md; ``paddle.distributed.launch``, gloo on the
CPU): ``paddle.distributed.init_parallel_env()`` and ``paddle.DataParallel(model)`` with its defaults (gradients
averaged over the ranks in its fused buckets), each rank its own micro-batches (``no_sync()`` but for the last); every
rank then steps the same optimizer on the same gradients and digests its own copy of the whole state (only the step's
losses are gathered). Expert parallel (``train.ep > 1``) is the family's PaddleFormers flex-token MoE layer (the
room's ``expert_parallel_layer``), whose token dispatch is DeepEP's fused all-to-all only (``fused_a2a``:
``paddlefleet_ops.deep_ep``, PaddleFleet's CUDA package): UNSUPPORTED naming it where it is not installed.

A parameter the backward never reached has no gradient (a routed expert no token has been routed to so far, in a
model that calls only the experts with tokens: GLM-4.5's ``Glm4MoeMoE``; DeepSeek-V3's calls every expert): Paddle's
optimizer skips it (no weight decay, no moment update, no step count) and creates its accumulators, zeros, at its
first gradient. The runner writes zeros for that gradient and that state, what the next step starts from, and lists
such parameters per step in meta.json (``zero_grads``); ``clear_grad()`` zeroes a gradient once made, which Paddle
steps from then on.

Paddle's Adam keeps its step count as fp32 running products (``beta1_pow_acc``, ``beta2_pow_acc``); its formula scales
eps by sqrt(1 - beta2^t) and folds the bias correction into the lr; its Momentum rounds every product on its own
(docs/training.md). Observers (change nothing):
``clip_norm_and_factor`` records the outputs of the one ``paddle.sqrt`` (the global norm) and the one ``paddle.divide``
(the clip factor) that ``ClipGradByGlobalNorm._dygraph_clip`` calls, since Paddle exposes neither.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
from safetensors import safe_open

from harness.capture.paddle import apply_rule, to_host
from harness.case.ops import carried_quantities, step_quantities, train_buffer_names, train_state_names
from harness.case.train_settings import TrainSettings, rank_micro_batches
from harness.families import model_config
from harness.run.protocol import Phases, rank_and_world
from harness.run.steps import StepWriter, await_handed, fed_marker, flip_bit, flips_here, state_locations, step_file
from harness.runners.paddle import families
from harness.runners.paddle import model as paddle_model
from harness.runners.paddle.model import paddle  # None where paddle is missing: run() says so first


@contextmanager
def clip_norm_and_factor(clip):
    """Record what ``paddle.sqrt`` and ``paddle.divide`` return while `clip`'s ``_dygraph_clip`` runs."""
    seen = {"sqrt": [], "divide": []}
    original_clip = clip._dygraph_clip

    def observed(params_grads):
        originals = {name: getattr(paddle, name) for name in seen}

        def recorder(name):
            def call(*args, **kwargs):
                out = originals[name](*args, **kwargs)
                seen[name].append(to_host(out))
                return out
            return call

        for name in seen:
            setattr(paddle, name, recorder(name))
        try:
            return original_clip(params_grads)
        finally:
            for name, function in originals.items():
                setattr(paddle, name, function)

    clip._dygraph_clip = observed
    try:
        yield seen
    finally:
        del clip._dygraph_clip


def run(request: dict, phases: Phases) -> dict:
    from harness.runners.paddle import paddlefleet_ops_shim

    provenance = paddle_model.admit(request)
    if request["device"] == "gpu":
        raise paddle_model.Unsupported("PaddleFormers' models train on the CPU only here: on a GPU the Paddle side is "
                                       "PaddleFleet's GPTModel, whose training loop is not written")
    with phases("import"):
        adapter = paddlefleet_ops_shim.install()
        import paddleformers
        m = model_config(request["config"]["model"])
        families.classes(m)
    train, dtype = TrainSettings.from_dict(request["config"]["train"]), request["dtype"]
    rank, world = rank_and_world()
    if world != train.dp:
        raise RuntimeError(f"paddle_model was started on {world} ranks; the request trains on dp = {train.dp}")
    if train.ep > 1:
        expert_parallel_dispatch(m)
    with phases("setup"):
        if world > 1:
            paddle.distributed.init_parallel_env()
        model, checkpoint, name_map, loaded = paddle_model.build_model(m, dtype,
                                                                       request["checkpoint"])
        trainer = Trainer(model, train, m, name_map, rank)
    writer = StepWriter(request["output_dir"], train.steps_kept, _save,
                        lambda a: np.ascontiguousarray(a).view(np.uint8), rank)
    refeed = request["config"].get("train_refeed")
    for step in range(1, train.steps + 1):
        with phases(f"step {step}"):
            if refeed:
                trainer.load_state(refeed, step, writer.paced)
            scalars, states = paddle_model._kernel_guard(
                lambda step=step: trainer.step(step, checkpoint, refeed), f"training step {step}", request, m)
            if scalars:
                writer.write(step, scalars, states)
            flip = train.flip
            if flips_here(flip, step, rank):
                value = flip_bit(trainer.one(flip.state, flip.tensor), flip.index, flip.bit)
                trainer.put(flip.state, flip.tensor, value)
    return {**provenance,
        "implementation": f"{families.model_name(m)} (Paddle dygraph, CPU) "
                          f"trained with paddle.optimizer.{type(trainer.optimizer).__name__}, "
                          "paddle.nn.ClipGradByGlobalNorm and "
                          f"paddle.optimizer.lr ({type(trainer.scheduler).__name__})",
        "versions": {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit,
                     "paddleformers": getattr(paddleformers, "__version__", "unknown")},
        "adapters": ([adapter] if adapter else []) + families.adapters(m) + [
            {"name": "clip_norm_and_factor", "why": "observer: " + clip_norm_and_factor.__doc__.strip(),
             "changes_computation": False}],
        "knobs": {**{k: {"value": v, "why": why} for k, (v, why) in families.knobs(m).items()}, **trainer.knobs},
        "state_locations": state_locations(m.family, "paddle", train.record,
                                           step_quantities(train.record)),
        "weights_loaded": loaded, "steps_kept": list(train.steps_kept), "refeed": refeed or {},
        "zero_grads": {f"step {step}": names for step, names in trainer.zero_grads.items() if names},
        "data_parallel": train.dp, "distributed_backend": "gloo" if world > 1 else None,
    }


def expert_parallel_dispatch(m) -> None:
    """On an expert-parallel group PaddleFormers builds the family's flex-token MoE layer (the room's
    ``expert_parallel_layer``); its tokens travel only through DeepEP (paddleformers/transformers/fused_a2a.py,
    HAVE_DEEP_EP from paddlefleet_ops)."""
    from paddleformers.transformers import fused_a2a

    layer = families.expert_parallel_layer(m)
    if not fused_a2a.HAVE_DEEP_EP:
        raise paddle_model.Unsupported(
            f"expert parallel: PaddleFormers' {layer} dispatches tokens only through DeepEP's fused "
            "all-to-all (paddleformers/transformers/fused_a2a.py; without it MoEFlexTokenDispatcher raises "
            "'ImportError: DeepEP is not supported in your paddlepaddle whl package.'), and paddlefleet_ops.deep_ep "
            "(PaddleFleet's CUDA package, not on PyPI) is not installed")
    raise RuntimeError("expert parallel with DeepEP installed: this runner trains PaddleFormers on the CPU only; "
                       "PaddleFleet's GPU model is not trained by the harness")


def _save(tensors: dict[str, np.ndarray], path: str, metadata: dict) -> None:
    from safetensors.numpy import save_file

    save_file({name: np.require(a, requirements="C") for name, a in tensors.items()}, path, metadata)


class Trainer:
    def __init__(self, model, train: TrainSettings, m, name_map, rank: int = 0):
        self.model, self.train = model, train
        self.mine, self.dp = rank_micro_batches(train.micro_batches, train.dp, rank), train.dp
        self.n = len(self.mine)
        # paddle.DataParallel's defaults: gradients averaged over the ranks, fused into buckets
        self.parallel = paddle.DataParallel(model) if self.dp > 1 else None
        self.float64 = paddle.get_default_dtype() == "float64"
        self.params = dict(model.named_parameters())
        self.rules = {name: name_map.rule("grads", name) for name, _ in train_state_names(m)}
        wanted = {name for name, _ in train_buffer_names(m)}  # Paddle buffer -> canonical by [paddle.checkpoint]
        self.buffers = {name_map.rule("checkpoint", paddle_name).sources[0]: buffer
                        for paddle_name, buffer in model.named_buffers()
                        if name_map.rule("checkpoint", paddle_name).sources[0] in wanted}
        if set(self.buffers) != wanted:
            raise RuntimeError(f"routing biases not found in the Paddle model: {sorted(wanted - set(self.buffers))}")
        self.scheduler = schedule(train)
        exempt = [p for p in self.params.values() if len(p.shape) <= 1] \
            if train.weight_decay_params == "not_1d" else []
        self.clip = paddle.nn.ClipGradByGlobalNorm(train.clip_grad) if train.clip_grad > 0 else None
        self.optimizer, knobs, decay = train.record.paddle(train.optimizer, self.scheduler, list(self.params.values()),
                                                           train.weight_decay, exempt, self.clip)
        self.accumulators = train.record.paddle_accumulators  # state quantity -> Paddle's accumulator
        self.carried = tuple(q for q in carried_quantities(train.record) if q != "master")  # no fp32 masters here
        self.zero_grads: dict[int, list[str]] = {}  # step -> parameters without a gradient so far (written as zeros)
        self.knobs = {
            **knobs,
            "weight_decay_params": {"value": train.weight_decay_params, "why": decay},
            "grad_clip": {"value": train.clip_grad, "why": "ClipGradByGlobalNorm (0: none)"},
            "scheduler": {"value": type(self.scheduler).__name__,
                          "why": f"{train.decay_style}, warmup {train.warmup_steps} from 0, decay to "
                                 f"{train.min_lr} over {train.decay_steps} steps"},
            "gradient_accumulation": {"value": self.n, "why": "(loss / micro_batches).backward() per micro-batch "
                                                             "of this rank"},
            "DataParallel": {"value": {"world_size": self.dp} if self.parallel else None,
                             "why": "paddle.DataParallel with its defaults, no_sync() but for the last micro-batch"
                             if self.parallel else "one rank"},
            "expert_bias_update": {"value": train.expert_bias_update, "why": "this training loop (Paddle's "
                                                                             "optimizer) never changes "
                                                                             "the routing bias"},
        }

    # --- one step --------------------------------------------------------------------------------------------------
    def step(self, step: int, checkpoint: dict, refeed: dict | None):
        losses = []
        for i, mb in enumerate(self.mine):
            ids = paddle.to_tensor(checkpoint[f"step{step}.mb{mb}.input_ids"].reshape(1, -1))
            labels = paddle.to_tensor(checkpoint[f"step{step}.mb{mb}.labels"].reshape(1, -1))
            model = self.model if self.parallel is None else self.parallel
            with nullcontext() if self.parallel is None or i == self.n - 1 else self.parallel.no_sync():
                out = model(input_ids=ids, labels=labels, return_dict=True)
                scaled = out.loss / self.n
                scaled.backward()
            losses.append(to_host(scaled).reshape(()))
        if refeed and refeed.get("mode") == "update":  # side a's gradients into this optimizer
            for key, value in _read(refeed["from"], step, [f"step{step}.grad.{n}" for n in self.rules]).items():
                self.put("grad", key.split(".", 2)[2], value)
        lr = self.optimizer.get_lr()
        if self.train.bare:  # bench_speed: Paddle's calls alone, nothing observed or written
            self.optimizer.step()
            self.optimizer.clear_grad()
            self.scheduler.step()
            return {}, {}
        grads = {f"grad.{name}": value.copy() for name, value in self.canonical("grad").items()}
        self.zero_grads[step] = self.without_gradient()
        clipping = {}  # without grad_clip Paddle computes neither a norm nor a factor: none is written as its own
        if self.clip is not None:
            with clip_norm_and_factor(self.clip) as seen:
                self.optimizer.step()
            if len(seen["sqrt"]) != 1 or len(seen["divide"]) != 1:
                raise RuntimeError(f"ClipGradByGlobalNorm called paddle.sqrt {len(seen['sqrt'])} and paddle.divide "
                                   f"{len(seen['divide'])} times; the observer expects once each (Paddle changed)")
            clipping = {"grad_norm": seen["sqrt"][0], "clip_coeff": seen["divide"][0]}
        else:
            self.optimizer.step()
        self.optimizer.clear_grad()
        self.scheduler.step()
        loss = global_losses(np.stack(losses), self.dp)  # float32 whatever the model's dtype (PaddleFormers'
        # criterion): float64 exactly
        wide = np.float64 if self.float64 else np.float32  # the gradients' dtype; Paddle's clip computes in it
        scalars = {"lr": np.asarray(lr, dtype=np.float64).reshape(()),
                   "loss": loss.astype(np.float64) if self.float64 else loss,
                   **{name: _at(wide, name, value) for name, value in clipping.items()}}
        states = dict(grads)
        for quantity in self.carried:
            states.update({f"{quantity}.{name}": value for name, value in self.canonical(quantity).items()})
        states.update({f"expert_bias.{name}": to_host(buffer) for name, buffer in self.buffers.items()})
        return scalars, {name: np.require(value, requirements="C") for name, value in states.items()}

    # --- state in canonical names (numpy), both ways -------------------------------------------------------------
    def source(self, quantity: str, name: str):
        """Paddle's tensor of `quantity` for its parameter `name`, or None where Paddle holds none yet: the gradient
        of a parameter the backward never reached (a routed expert no token has been routed to so far, in a model
        that calls only the experts with tokens: GLM-4.5's Glm4MoeMoE), and the optimizer state of such a
        parameter (AdamW and Momentum skip a parameter without a gradient and create its accumulators, zeros, at its
        first one)."""
        param = self.params[name]
        if quantity == "param":
            return param
        if quantity == "grad":
            return param.grad
        if quantity in self.accumulators:
            return self.optimizer._accumulators[self.accumulators[quantity]].get(param.name)
        raise ValueError(f"paddle_model keeps no {quantity!r} (float32 parameters have no masters)")

    def host(self, quantity: str, name: str) -> np.ndarray:
        """`source` on the host; where Paddle holds none yet, the zeros it would start from (a gradient the
        backward did not reach is written as zeros, as the model level writes it; an accumulator is created
        zero-filled)."""
        tensor = self.source(quantity, name)
        if tensor is not None:
            return to_host(tensor)
        param = self.params[name]
        return np.zeros(param.shape, dtype=str(param.dtype).removeprefix("paddle."))

    def one(self, quantity: str, name: str) -> np.ndarray:
        rule = self.rules[name]
        return np.ascontiguousarray(apply_rule(rule, [self.host(quantity, s) for s in rule.sources]))

    def without_gradient(self) -> list[str]:
        """The canonical names whose Paddle parameters got no gradient so far (``param.grad`` None)."""
        return [name for name, rule in self.rules.items() if any(self.params[s].grad is None for s in rule.sources)]

    def create(self, quantity: str, name: str, value: np.ndarray):
        """A load (re-feed) of a nonzero `value` where Paddle holds no tensor yet (``source`` None): made as Paddle
        makes it at the parameter's first gradient (the gradient set; the optimizer's own ``_create_accumulators``,
        its step counts, AdamW's beta powers, starting there), then holding `value`."""
        param = self.params[name]
        if quantity == "grad":
            param._set_grad_ivar(paddle.to_tensor(np.ascontiguousarray(value), place=paddle.CPUPlace()))
            return param.grad
        self.optimizer._create_accumulators(paddle.static.default_main_program().global_block(), [param])
        return self.source(quantity, name)

    def canonical(self, quantity: str) -> dict[str, np.ndarray]:
        return {name: self.one(quantity, name) for name in self.rules}

    def put(self, quantity: str, name: str, value: np.ndarray) -> None:
        rule = self.rules[name]
        targets = [self.source(quantity, s) for s in rule.sources]
        shapes = [self.params[s].shape for s in rule.sources]  # every quantity's shape is its parameter's
        if rule.kind == "same":
            parts = [value]
        elif rule.kind == "transpose":
            parts = [np.swapaxes(value, -1, -2)]
        elif rule.kind in ("cat0", "transpose_cat0"):
            rows = [shape[-1] if rule.kind == "transpose_cat0" else shape[0] for shape in shapes]
            parts = np.split(value, np.cumsum(rows)[:-1], axis=0)
            parts = [np.swapaxes(p, -1, -2) for p in parts] if rule.kind == "transpose_cat0" else parts
        elif rule.kind in ("deinterleave", "transpose_deinterleave"):  # one part of a fused tensor (q of qkv_proj)
            fused = self.host(quantity, rule.sources[0])  # the other parts' rows as they are
            rows = np.swapaxes(fused, -1, -2) if rule.kind == "transpose_deinterleave" else fused
            if value.dtype != fused.dtype or tuple(value.shape) != (len(rule.rows(rule.index)), *rows.shape[1:]):
                raise ValueError(f"re-feed: {quantity}.{name} is {value.dtype}{list(value.shape)}, its part of "
                                 f"Paddle's {rule.sources[0]} {fused.dtype}{list(fused.shape)}: a load keeps every "
                                 "bit or is refused")
            rows[rule.rows(rule.index)] = value  # a view of `fused`: its rows (columns of a transposed weight)
            parts = [fused]
        else:
            raise ValueError(f"rule {rule.kind!r} cannot be written back")
        for source, target, part in zip(rule.sources, targets, parts, strict=True):
            if target is None:  # Paddle holds none yet: all-zero bits are what it starts from, so nothing to load
                if not np.ascontiguousarray(part).view(np.uint8).any():
                    continue
                target = self.create(quantity, source, part)
            _fits(part, target, f"{quantity}.{name}")
            target.set_value(paddle.to_tensor(np.ascontiguousarray(part), place=paddle.CPUPlace()))

    def load_state(self, refeed: dict, step: int, beside: bool = False) -> None:
        """Side a's parameters and optimizer state after step - 1, and side a's lr for this step (the scheduler's
        last_lr, which the optimizer reads). AdamW's beta powers (Paddle's step count) stay this run's own. `beside`:
        this run is paced, beside side a (harness.run.steps.await_handed)."""
        if step > 1:
            names = [f"step{step - 1}.{q}.{n}" for q in self.carried for n in self.rules]
            names += [f"step{step - 1}.expert_bias.{n}" for n in self.buffers]
            for key, value in _read(refeed["from"], step - 1, names).items():
                _, quantity, name = key.split(".", 2)
                if quantity == "expert_bias":
                    _fits(value, self.buffers[name], key)
                    self.buffers[name].set_value(paddle.to_tensor(value, place=paddle.CPUPlace()))
                else:
                    self.put(quantity, name, value)
            if beside:
                fed_marker(refeed["from"], step - 1, refeed["mode"]).touch()
        if beside:
            await_handed(refeed["from"], step, refeed["mode"])
        self.scheduler.last_lr = float(_read(refeed["from"], step, [f"step{step}.lr"])[f"step{step}.lr"])


def _fits(value: np.ndarray, target, where: str) -> None:
    """Refuse a load (re-feed, planted flip) that would change a tensor's dtype or shape: set_value casts silently, and
    a re-feed that rounded what it loads would report differences it made itself (issue 29, finding 5)."""
    dtype = str(target.dtype).removeprefix("paddle.")
    if str(value.dtype) != dtype or tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"re-feed: {where} is {value.dtype}{list(value.shape)}, Paddle's tensor "
                         f"{dtype}{list(target.shape)}: a load keeps every bit or is refused")


def _at(dtype, name: str, value) -> np.ndarray:
    """A scalar Paddle computed, in the gradients' `dtype` (an exact widening at most: never rounded by the harness)."""
    value = np.asarray(value).reshape(())
    if not np.can_cast(value.dtype, dtype, "safe"):
        raise RuntimeError(f"Paddle computed the {name} in {value.dtype}, wider than the gradients' {np.dtype(dtype)}")
    return value.astype(dtype)


def global_losses(local: np.ndarray, dp: int) -> np.ndarray:
    """The step's losses in global micro-batch order, each a micro-batch's share of the global step's loss (its local
    loss / dp: harness.runners.torch.ranks.global_losses says why); a copy through all_gather_object."""
    if dp == 1:
        return local
    per_rank: list = []
    paddle.distributed.all_gather_object(per_rank, local)
    return np.stack([per_rank[m % dp][m // dp] for m in range(dp * local.size)]) / local.dtype.type(dp)


def _read(folder, step: int, names) -> dict[str, np.ndarray]:
    path = step_file(folder, step)
    with safe_open(str(path), framework="numpy") as handle:
        missing = [n for n in names if n not in set(handle.keys())]
        if missing:
            raise RuntimeError(f"re-feed: side a's {path} lacks {missing[0]}: side a must keep every step's tensors")
        return {name: handle.get_tensor(name) for name in names}


def schedule(train: TrainSettings):
    lr = paddle.optimizer.lr
    if train.decay_style == "cosine":
        inner = lr.CosineAnnealingDecay(learning_rate=train.lr, T_max=max(1, train.decay_steps - train.warmup_steps),
                                        eta_min=train.min_lr)
    else:
        inner = train.lr
    if train.warmup_steps > 0:
        return lr.LinearWarmup(learning_rate=inner, warmup_steps=train.warmup_steps, start_lr=0.0, end_lr=train.lr)
    return inner if isinstance(inner, lr.LRScheduler) else lr.LambdaDecay(train.lr, lambda epoch: 1.0)
