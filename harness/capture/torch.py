"""Capture a torch model's module outputs and parameter gradients, in canonical names, into one safetensors file.

Wrap it around your own training step::

    from harness.capture.torch import capture
    from harness.families.names import NameMap

    with capture(model, "step.safetensors", name_map=NameMap.load(family, "hf")) as cap:  # family: a FAMILIES name
        logits = model(input_ids).logits
        loss = loss_fn(logits, labels)
        loss.backward()
        cap.record("loss", loss)        # any extra tensor, under the name you give it
        cap.record("logits", logits[0])

Interface (``harness.capture.paddle`` has the same):

- ``capture(model, path, *, name_map=None, modules=None, grads=None, batch_dim=0)``: a context manager giving a
  ``Capture``. ``path``: the safetensors file written when the block ends without an exception (None: write
  nothing, read ``cap.tensors``). ``name_map``: a ``harness.families.names.NameMap`` (its ``modules`` and ``grads``
  tables say how canonical names are made from the framework's); None: canonical names are the framework's own.
  ``modules``: canonical module paths to capture (None: every submodule under its own name; [] none).
  ``grads``: canonical parameter names whose gradients to write (None: every parameter under its own name).
  ``batch_dim``: the batch dimension of module outputs, dropped when its size is 1 on outputs of 3 or more dims
  (HF: 0; Megatron: 1).
- Written names: ``module.<canonical module path>`` (the module's output, or what its name-map rule says: the
  input of another module, outputs concatenated on the last dim, one part of a fused q/k/v output), ``grad.<canonical
  parameter name>`` (``.grad`` after backward, through the rule: same, cat0, a slice of a fused tensor, transpose,
  one part of a fused q/k/v), and what ``record`` got.
- ``cap.record(name, tensor)``; after the block ``cap.tensors`` (name -> tensor, on the CPU), ``cap.not_captured``
  (name -> why: a rule says it cannot be observed here, or the module never ran), ``cap.zero_grads`` (parameters
  whose ``.grad`` was None, written as zeros: e.g. an expert that got no token).

Nothing is recomputed: a module output is the tensor the forward produced (detached, cloned at once so in-place
updates later cannot change it); a gradient is the tensor autograd left in ``.grad``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from safetensors.torch import save_file

from harness.capture import RefeedBook, input_key, main_input, module_sources
from harness.families.names import NameMap, Rule


class Capture:
    def __init__(self, model: torch.nn.Module, name_map: NameMap | None, batch_dim: int | None):
        self.model, self.name_map, self.batch_dim = model, name_map, batch_dim
        self.tensors: dict[str, torch.Tensor] = {}
        self.not_captured: dict[str, str] = {}
        self.zero_grads: list[str] = []
        self._seen: dict[str, dict[str, torch.Tensor]] = {}  # framework module path -> {"input"/"output": tensor}
        self.ran: list[str] = []  # the framework module paths seen, in the order the forward reached them
        self._hooked: set[tuple[str, bool]] = set()
        self._handles: list = []
        self._module_rules: dict[str, Rule] = {}

    def record(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor.detach().clone()

    # --- modules ---
    def watch(self, modules: list[str] | None) -> None:
        named = dict(self.model.named_modules())
        canonical = modules if modules is not None else [n for n in named if n]
        for name in canonical:
            rule = self.name_map.rule("modules", name) if self.name_map else Rule("same", (name,))
            self._module_rules[name] = rule
            if rule.kind == "not_captured":
                self.not_captured["module." + name] = rule.why
                continue
            for source in rule.sources:
                if source not in named:
                    self.not_captured["module." + name] = f"the model has no module {source!r}"
                    break
                self._hook(source, named[source], want_input=rule.kind == "input_of")

    def _hook(self, path: str, module: torch.nn.Module, want_input: bool) -> None:
        if (path, want_input) in self._hooked:
            return
        self._hooked.add((path, want_input))
        self._seen.setdefault(path, {})
        if want_input:
            def pre(mod, args, path=path):
                self._store(path, "input", args[0])
            self._handles.append(module.register_forward_pre_hook(pre))
        else:
            def post(mod, args, output, path=path):
                self._store(path, "output", output[0] if isinstance(output, tuple) else output)
            self._handles.append(module.register_forward_hook(post))

    def _store(self, path: str, what: str, tensor: torch.Tensor) -> None:
        if not self._seen[path]:
            self.ran.append(path)
        if what in self._seen[path]:
            self._seen[path]["_repeated"] = True
        self._seen[path][what] = tensor.detach().clone()

    def _module_tensor(self, name: str, rule: Rule) -> torch.Tensor | None:
        parts, why = module_sources(self._seen, rule)
        if why:
            self.not_captured["module." + name] = why
            return None
        if rule.kind == "tokens_of":
            return parts[0].reshape(-1, parts[0].shape[-1])
        parts = [self._drop_batch(part) for part in parts]
        if rule.kind == "deinterleave":  # one part of a fused module's output (q of linear_qkv), on the last dim
            return apply_rule(rule, parts, dim=-1)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _drop_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        # 3 or more dims only: a 2-D output is already [tokens, ...] (an expert that got one token stays [1, hidden])
        if self.batch_dim is not None and tensor.dim() >= 3 and tensor.shape[self.batch_dim] == 1:
            return tensor.squeeze(self.batch_dim)
        return tensor

    # --- gradients ---
    def grads(self, names: list[str] | None) -> None:
        params = dict(self.model.named_parameters())
        for name in names if names is not None else list(params):
            rule = self.name_map.rule("grads", name) if self.name_map else Rule("same", (name,))
            sources = []
            for source in rule.sources:
                if source not in params:
                    raise KeyError(f"gradient {name!r}: the model has no parameter {source!r} (rule {rule.kind})")
                grad = params[source].grad
                if grad is None:
                    self.zero_grads.append(source)
                    grad = torch.zeros_like(params[source])
                sources.append(grad.detach())
            self.tensors["grad." + name] = apply_rule(rule, sources).clone()

    def finish(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, rule in self._module_rules.items():
            if rule.kind == "not_captured":
                continue
            tensor = self._module_tensor(name, rule)
            if tensor is not None:
                self.tensors["module." + name] = tensor


def apply_rule(rule: Rule, sources: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """A canonical tensor from the framework tensors its rule names, or (a checkpoint rule) a framework tensor from
    canonical ones: exact, only copies, never arithmetic. `dim`: where the interleave kinds interleave (0: weights
    and gradients; -1: module outputs)."""
    if rule.kind == "same":
        return sources[0]
    if rule.kind == "transpose":
        return sources[0].transpose(-1, -2)
    if rule.kind == "slice":
        return sources[0][rule.index]
    if rule.kind == "cat0":
        return torch.cat(sources, dim=0)
    if rule.kind == "transpose_cat0":
        return torch.cat([s.transpose(-1, -2) for s in sources], dim=0)
    if rule.kind == "cat0_transpose":
        return torch.cat(sources, dim=0).transpose(-1, -2)
    if rule.kind == "cat_last":
        return torch.cat(sources, dim=-1)
    if rule.kind in ("interleave", "transpose_interleave"):
        joined = torch.cat(sources, dim=dim)
        fused = joined.index_select(dim, torch.tensor(rule.rows(), device=joined.device))
        return fused.transpose(-1, -2) if rule.kind == "transpose_interleave" else fused
    if rule.kind in ("deinterleave", "transpose_deinterleave"):
        fused = sources[0].transpose(-1, -2) if rule.kind == "transpose_deinterleave" else sources[0]
        return fused.index_select(dim, torch.tensor(rule.rows(rule.index), device=fused.device))
    raise ValueError(f"rule {rule.kind!r} does not apply to gradients")


@contextmanager
def capture(model: torch.nn.Module, path, *, name_map: NameMap | None = None, modules: list[str] | None = None,
            grads: list[str] | None = None, batch_dim: int | None = 0):
    cap = Capture(model, name_map, batch_dim)
    cap.watch(modules)
    try:
        yield cap
    except BaseException:
        cap.finish()
        raise
    cap.finish()
    cap.grads(grads)
    cap.tensors = {k: v.detach().to("cpu").contiguous() for k, v in cap.tensors.items()}
    if path is not None:
        save_file(cap.tensors, str(path))


# --- per-module re-feed (harness.capture: REFEED_FILE) -------------------------------------------------------------

class _Substitute(torch.autograd.Function):
    """Forward: side a's value in place of the local tensor; backward: the gradient passes to the local tensor
    unchanged, so the graph stays whole (every unit upstream still gets a gradient to replace)."""

    @staticmethod
    def forward(ctx, local, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Refeed(RefeedBook):
    """Hooks for one re-feed run; see harness.capture (REFEED_FILE). Register after ``capture`` so that its hooks
    see the local tensors (torch runs hooks in registration order). `units`: {canonical: [module paths]};
    `keep_output`: units whose output goes on unreplaced (lm_head: the logits are the loss's input); `arguments`:
    {unit: names of its first positional tensor arguments} for a unit taking several (Megatron's core attention:
    query, key, value), else its one input (the first argument or ``hidden_states``)."""

    def __init__(self, model, units: dict[str, list[str]], mode: str, source=None, batch_dim: int = 0,
                 keep_output=("lm_head",), arguments: dict | None = None):
        from safetensors.torch import load_file

        super().__init__(mode, batch_dim, keep_output, load_file(str(source)) if mode == "replay" else {}, arguments)

        def hook(unit, index, parts, module):
            self._handles.append(module.register_forward_pre_hook(self._pre(unit, index, parts), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(unit, index, parts)))
        self.hook_units(units, dict(model.named_modules()), "module", hook)

    def _canonical(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.dim() >= 3 and tensor.shape[self.batch_dim] == 1:
            tensor = tensor.squeeze(self.batch_dim)
        return tensor.clone()

    def _fit(self, key: str, unit: str, index: int, parts: int, local: torch.Tensor, what: str):
        value = self.fitted(key, unit, index, parts, local, what)
        return None if value is None else value.reshape(local.shape).to(local.device)

    def _slots(self, unit: str, args: tuple, kwargs: dict) -> list[tuple[str, tuple]]:
        """(argument name, where) of each tensor argument to replace: ("arg", i) or ("kw", name)."""
        names = self.arguments_of(unit)
        if len(names) > 1:
            return [(name, ("arg", i)) for i, name in enumerate(names) if i < len(args)]
        where = main_input(args, kwargs)
        return [] if where is None else [(names[0], where)]

    def _pre(self, unit: str, index: int, parts: int):
        def hook(module, args, kwargs):
            if not self.first_call(unit, index, "module"):
                return None
            args, kwargs, changed = list(args), dict(kwargs), False
            for name, (kind, at) in self._slots(unit, args, kwargs):
                x = args[at] if kind == "arg" else kwargs[at]
                if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                    continue  # token ids: the same checkpoint tensor on both sides
                key = input_key(unit, name)
                if index == 0:
                    self.tensors[key] = self._canonical(x)  # record: a's input; replay: the local one
                if self.mode != "replay":
                    continue
                value = self._fit(key, unit, 0, 1, x, name)
                if value is None:
                    continue
                self.note(unit, name)
                new = _Substitute.apply(x, value)
                if kind == "arg":
                    args[at] = new
                else:
                    kwargs[at] = new
                changed = True
            return (tuple(args), kwargs) if changed else None
        return hook

    def _post(self, unit: str, index: int, parts: int):
        def hook(module, args, output):
            if self.calls.get((unit, index), 0) > 1:
                return None
            y = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(y, torch.Tensor) or not y.is_floating_point():
                self.not_refed[unit] = "its output is no floating-point tensor"
                return None
            if self.mode != "replay":
                self.parts.setdefault(self.keys[1] + unit, {})[index] = self._canonical(y)
                if y.requires_grad:
                    y.register_hook(lambda g: self.parts.setdefault(self.keys[2] + unit, {}).__setitem__(
                        index, self._canonical(g)))
                return None
            new = y
            if unit not in self.keep_output:
                value = self._fit(self.keys[1] + unit, unit, index, parts, y, "output")
                if value is not None:
                    new = _Substitute.apply(y, value)
                    self.note(unit, "output")
            grad = self._fit(self.keys[2] + unit, unit, index, parts, y, "output gradient") if y.requires_grad \
                else None
            if grad is not None and new.requires_grad:
                def swap(g, key=self.keys[2] + unit):  # keep the local gradient (the code after the unit made it)
                    self.parts.setdefault(key, {})[index] = self._canonical(g)
                    return grad.to(g.dtype)
                new.register_hook(swap)
                self.note(unit, "output gradient")
            if new is y:
                return None
            return type(output)([new, *output[1:]]) if isinstance(output, (tuple, list)) else new
        return hook

    def finish(self) -> dict[str, torch.Tensor]:
        """The tensors to write (record: side a's inputs, outputs, output gradients; replay: the local inputs and the
        local gradients that arrived at each unit's output before side a's replaced them)."""
        joined = self.joined(lambda parts: torch.cat(parts, dim=-1))
        return {k: v.detach().to("cpu").contiguous() for k, v in joined.items()}
