"""A torch training run's per-parameter state in canonical names, both ways: read for the per-step dumps, written back
for the negative control's planted bit and for the re-feed in time (side b starts a step from side a's state).

``States`` is the interface (``canonical(quantity)``, ``put(quantity, name, value)``, ``carried``: what a step hands
to the next); ``TorchStates`` implements it through name-map rules (hf_model: the ``[hf.grads]`` rule of each canonical
name, applied to the parameter, its master, its gradient or its optimizer state alike: torch's optimizers key their
state by the canonical quantity names, ``state[p]["exp_avg"]``, ``state[p]["momentum_buffer"]``); Megatron's runner has
its own (``harness.runners.megatron.train.MegatronStates``: a canonical tensor is a Megatron parameter, or the rows
of one part of a fused one, as the family's name map says).
Writing back inverts the rule with copies only (a slice of a fused tensor, the halves of a cat0, a transpose, one
part's rows of a tensor that interleaves q, k and v per query group).
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from harness.capture.torch import apply_rule
from harness.case.ops import train_buffer_names, train_state_names
from harness.run.steps import await_handed, fed_marker, step_file

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}


class TorchStates:
    def __init__(self, rules: dict, params: dict, masters: dict, optimizer, carried: tuple[str, ...],
                 fill_absent_grads: bool = True):
        self.rules, self.params, self.masters, self.optimizer = rules, params, masters, optimizer
        self.carried = carried  # what a step hands to the next (harness.case.ops.carried_quantities)
        self.buffers: dict[str, torch.Tensor] = {}  # canonical routing-bias name -> the model's buffer
        # hf_model's runner gives a parameter without a gradient a zero one (its optimizer then steps it, as
        # Megatron's zeroed gradient buffers do); a recorder in a user's loop changes nothing: it reads zeros and
        # names the parameter (``absent``, the names read without a gradient since the last ``grads()``), and reads
        # the optimizer state of a parameter never stepped as the zeros the optimizer would start it from
        self.fill_absent_grads = fill_absent_grads
        self.absent: set[str] = set()

    @classmethod
    def hf(cls, model, m, name_map, optimizer, carried: tuple[str, ...], masters: dict | None = None,
           fill_absent_grads: bool = True) -> TorchStates:
        """An HF model's state (hf_model's runner, and the recorder in a user's HF loop: ``harness.attach``): each
        canonical parameter through its ``[hf.grads]`` rule, the routing biases by their checkpoint names (HF's buffer
        names are the checkpoint's)."""
        rules = {name: name_map.rule("grads", name, m) for name, _ in train_state_names(m)}
        states = cls(rules, dict(model.named_parameters()), masters or {}, optimizer, carried, fill_absent_grads)
        buffers = dict(model.named_buffers())
        states.buffers = {name: buffers[name] for name, _ in train_buffer_names(m)}
        return states

    def source(self, quantity: str, name: str, filled: bool = False) -> torch.Tensor:
        """The framework tensor behind `name`'s `quantity`; `filled`: a missing gradient is given a zero one (a
        tensor to write into)."""
        optimized = self.masters.get(name, self.params[name])
        if quantity == "grad":
            if optimized.grad is None:
                if not (filled or self.fill_absent_grads):
                    self.absent.add(name)
                    return torch.zeros_like(optimized)
                optimized.grad = torch.zeros_like(optimized)
            return optimized.grad
        if quantity == "param":
            return self.params[name]
        if quantity == "master":
            return self.masters[name]
        state = self.optimizer.state.get(optimized, {})
        if not state and not (self.fill_absent_grads or filled):  # never stepped (never had a gradient): the state
            return torch.zeros_like(optimized)  # it would make; one to write into is refused below (none to hold it)
        if quantity not in state:
            raise RuntimeError(f"{type(self.optimizer).__name__} keeps no {quantity!r} for {name} (it has "
                               f"{sorted(state)})")
        return state[quantity]

    def canonical(self, quantity: str) -> dict[str, torch.Tensor]:
        return {name: self.one(quantity, name) for name in self.rules}

    def one(self, quantity: str, name: str) -> torch.Tensor:
        rule = self.rules[name]
        return apply_rule(rule, [self.source(quantity, s) for s in rule.sources])

    def grads(self, copied: bool = True) -> dict[str, torch.Tensor]:
        """The gradients the optimizer is about to consume, canonical and copied (clipping and the step change them in
        place; not `copied`: to be digested at once), keyed ``grad.<p>``."""
        self.absent = set()
        return {f"grad.{name}": tensor.clone() if copied else tensor for name, tensor in self.canonical("grad").items()}

    def digest_grads(self) -> dict:
        """``grads()`` digested where they are instead of copied (``harness.runners.torch.digest.Digested``): what a
        step that is not kept writes of them, without a copy of every gradient (17.6 GB at full width)."""
        from harness.runners.torch.digest import digest_now

        return digest_now(self.grads(copied=False))

    def step_outputs(self, grads: dict) -> dict:
        """What a step writes of the state, in the step's order (``harness.case.ops.step_quantities``): `grads` as
        ``grads()`` or ``digest_grads()`` gave them, then, after the optimizer's step, what it hands to the next
        (``carried``: the optimizer's state, the masters where there are any, the parameters) and the routing biases.
        The one reader of hf_model's runner and of the recorder in a user's torch loop (``harness.attach``)."""
        states = {}
        for quantity in self.carried:
            if quantity == "master" and not self.masters:
                continue
            states.update({f"{quantity}.{name}": tensor for name, tensor in self.canonical(quantity).items()})
        states.update({f"expert_bias.{name}": buffer for name, buffer in self.buffers.items()})
        return {**grads, **{name: tensor.detach() for name, tensor in states.items()}}

    @torch.no_grad()
    def put(self, quantity: str, name: str, value: torch.Tensor) -> None:
        rule = self.rules[name]
        put_rule(rule, [self.source(quantity, s, filled=True) for s in rule.sources], value)


def put_rule(rule, targets: list[torch.Tensor], value: torch.Tensor) -> None:
    """Copy a canonical tensor into the framework tensors its rule reads (the inverse of ``apply_rule``)."""
    if tuple(apply_rule(rule, targets).shape) != tuple(value.shape):
        raise ValueError(f"canonical shape {list(value.shape)} does not fit rule {rule.kind} of {rule.sources}")
    for target in targets:
        keeps_bits(value, target.dtype, f"{rule.sources[0]} ({rule.kind})")
    if rule.kind == "same":
        targets[0].copy_(value)
    elif rule.kind == "transpose":
        targets[0].copy_(value.transpose(-1, -2))
    elif rule.kind == "slice":
        targets[0][rule.index].copy_(value)
    elif rule.kind in ("cat0", "transpose_cat0"):
        start = 0
        for target in targets:
            rows = target.shape[-1] if rule.kind == "transpose_cat0" else target.shape[0]
            part = value[start:start + rows]
            target.copy_(part.transpose(-1, -2) if rule.kind == "transpose_cat0" else part)
            start += rows
    elif rule.kind in ("deinterleave", "transpose_deinterleave"):  # one part of a fused tensor: its rows, in place
        fused = targets[0].transpose(-1, -2) if rule.kind == "transpose_deinterleave" else targets[0]
        fused[torch.tensor(rule.rows(rule.index), device=fused.device)] = value
    else:
        raise ValueError(f"rule {rule.kind!r} cannot be written back")


def keeps_bits(value: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    """Refuse a load that would change a value: another dtype is accepted only where it holds every element exactly
    (Megatron's float32 routing bias, written upcast in a float64 case). A re-feed that rounded what it loads would
    report differences it made itself (issue 29, finding 5)."""
    if value.dtype == dtype:
        return
    back = value.to(dtype).to(value.dtype)
    if not torch.equal(back.view(INT_VIEW[value.dtype]), value.view(INT_VIEW[value.dtype])):
        raise ValueError(f"re-feed: loading {where} would round its {value.dtype} value to {dtype}: a load keeps "
                         "every bit or is refused")


def host_bytes(tensor: torch.Tensor):
    """A tensor's raw bytes on the host (for its digest), one tensor at a time: a full-size step's state does not fit
    the host's memory at once."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy()


def device_digests(device: torch.device):
    """The step writer's `digests` for a run on `device` (harness.run.steps): on a GPU ``bits128v1`` computed on the GPU
    (harness.runners.torch.digest: 16 bytes per tensor come to the host, not the tensor); on the CPU None, the host's
    XXH3 of the tensor where it is (about 40x faster there than bits128v1 in torch: docs/speed.md). On a GPU it digests
    one small tensor first: the kernel's build (once per machine) and load (once per process) then fall in the
    runner's setup, where this is called, not in its first step."""
    if device.type == "cpu":
        return None
    from harness.runners.torch.digest import digests

    digests([torch.zeros(1, dtype=torch.int64, device=device)])
    return digests


def digests_used(device: torch.device) -> str:
    """What digests the step tensors that are not kept, on `device` (meta.json's ``step_digests``)."""
    if device.type == "cpu":
        return "xxh3_128 of the host copy (xxhash)"
    from harness.runners.torch.digest import implementation

    return implementation(device)


def save_on_host(tensors: dict[str, torch.Tensor], path: str, metadata: dict) -> None:
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, path, metadata)


@torch.no_grad()
def flip_state(states, flip) -> None:
    """The negative control (a ``harness.case.train_settings.Flip``): one bit of one element of one state tensor,
    through the framework's own tensor."""
    value = states.one(flip.state, flip.tensor).clone()
    bits = value.view(INT_VIEW[value.dtype])
    index = tuple(flip.index)
    mask = torch.tensor(1 << flip.bit, dtype=bits.dtype)  # the registry keeps the bit below the sign bit
    bits[index] = torch.bitwise_xor(bits[index], mask)
    states.put(flip.state, flip.tensor, value)


def _read(folder, step: int, names) -> dict[str, torch.Tensor]:
    path = step_file(folder, step)
    with safe_open(str(path), framework="pt") as handle:
        available = set(handle.keys())
        missing = [n for n in names if n not in available]
        if missing:
            raise RuntimeError(f"re-feed: side a's {path} lacks {missing[0]} ({len(missing)} missing): side a must "
                               "keep every step's tensors (train.steps_kept = \"all\")")
        return {name: handle.get_tensor(name) for name in names}


@torch.no_grad()
def load_state(states, refeed: dict, step: int, set_lr, beside: bool = False) -> None:
    """Side a's state after step - 1 (parameters, masters, the optimizer's state, the routing biases) into this run,
    and side a's lr for this step. The step count stays this run's own: it made the same number of steps. `beside`:
    this run is paced, beside side a (harness.run.steps.await_handed)."""
    folder = refeed["from"]
    if step > 1:
        quantities = [q for q in states.carried if q != "master" or getattr(states, "masters", True)]
        names = [f"step{step - 1}.{q}.{n}" for q in quantities for n in states.rules]
        names += [f"step{step - 1}.expert_bias.{n}" for n in states.buffers]
        for key, value in _read(folder, step - 1, names).items():
            _, quantity, name = key.split(".", 2)
            if quantity == "expert_bias":
                keeps_bits(value, states.buffers[name].dtype, name)
                if tuple(value.shape) != tuple(states.buffers[name].shape):
                    raise ValueError(f"re-feed: {key} is {list(value.shape)}, the buffer "
                                     f"{list(states.buffers[name].shape)}")
                states.buffers[name].copy_(value)
            else:
                states.put(quantity, name, value)
        if beside:
            fed_marker(folder, step - 1, refeed["mode"]).touch()
    if beside:
        await_handed(folder, step, refeed["mode"])
    set_lr(float(_read(folder, step, [f"step{step}.lr"])[f"step{step}.lr"]))


@torch.no_grad()
def load_grads(states, refeed: dict, step: int) -> None:
    """Side a's accumulated gradients of this step in place of this run's (the update re-fed alone)."""
    names = [f"step{step}.grad.{n}" for n in states.rules]
    for key, value in _read(refeed["from"], step, names).items():
        states.put("grad", key.split(".", 2)[2], value)
