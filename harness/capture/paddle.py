"""Capture a Paddle dygraph model's module outputs and parameter gradients, in canonical names, into one safetensors
file: the same small interface as ``harness.capture.torch``.

Wrap it around your own training step::

    from harness.capture.paddle import capture

    with capture(model, "step.safetensors", name_map=name_map, modules=modules, grads=grads) as cap:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        cap.record("loss", out.loss)
        cap.record("logits", out.logits[0])

- ``capture(model, path, *, name_map=None, modules=None, grads=None, batch_dim=0)``: a context manager giving a
  ``Capture``. ``path``: the safetensors file written when the block ends without an exception (None: write
  nothing, read ``cap.tensors``). ``name_map``: the framework's name map (``NameMap.load(family, "paddle")``: an
  object whose ``rule(section, name)`` gives ``kind``, ``sources``, ``index``, ``why``); None: canonical names are
  Paddle's own. ``modules``: canonical module paths to capture (None: every sublayer under its own name; [] none).
  ``grads``: canonical parameter names whose gradients to write (None: every parameter under its own name).
  ``batch_dim``: the batch dimension of module outputs, dropped when its size is 1 on outputs of 3 or more dims
  (2-D outputs, such as an expert's ``[tokens, hidden]``, are token-major already, even with one token).
- Written names: ``module.<canonical module path>`` (the sublayer's output, or what its rule says: the input of
  another sublayer, outputs concatenated on the last dim, one part of a fused q/k/v output), ``grad.<canonical
  parameter name>`` (``.grad`` after backward, through the rule: same, transpose, cat0, transpose_cat0, a slice, one
  part of a fused q/k/v), and what ``record`` got.
- ``cap.record(name, tensor)``; after the block ``cap.tensors`` (name -> numpy array on the host; bf16 as its uint16
  bits, which the writer turns back into bf16), ``cap.not_captured`` (name -> why), ``cap.zero_grads`` (parameters
  whose ``.grad`` was None, written as zeros), ``cap.write_seconds``.

Nothing is recomputed: a module output is the tensor the forward produced, copied to the host at once (so later
in-place updates cannot change it); a gradient is the tensor autograd left in ``.grad``. The rules only copy,
transpose, concatenate or slice.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import numpy as np
import paddle

from harness.capture import RefeedBook, input_key, module_sources


def to_host(tensor) -> np.ndarray:
    """A host copy as numpy (bf16 comes back as its uint16 bits, as ``Tensor.numpy()`` gives it)."""
    return np.array(tensor.detach().cpu().numpy(), copy=True)


class _Same:
    def __init__(self, name: str):
        self.kind, self.sources, self.index, self.why = "same", (name,), None, ""


class Capture:
    def __init__(self, model, name_map, batch_dim: int | None):
        self.model, self.name_map, self.batch_dim = model, name_map, batch_dim
        self.tensors: dict[str, np.ndarray] = {}
        self.order: list[str] = []
        self.not_captured: dict[str, str] = {}
        self.zero_grads: list[str] = []
        self.write_seconds = 0.0
        self._seen: dict[str, dict[str, np.ndarray]] = {}  # framework sublayer path -> {"input"/"output": array}
        self.ran: list[str] = []  # the framework sublayer paths seen, in the order the forward reached them
        self._hooked: set[tuple[str, bool]] = set()
        self._handles: list = []
        self._module_rules: dict = {}

    def rule(self, section: str, name: str):
        return self.name_map.rule(section, name) if self.name_map is not None else _Same(name)

    def record(self, name: str, tensor) -> None:
        self._keep(name, to_host(tensor))

    def _keep(self, name: str, array: np.ndarray) -> None:
        self.tensors[name] = np.array(array, order="C", copy=True)  # (np.ascontiguousarray makes 0-d arrays 1-d)
        if name not in self.order:
            self.order.append(name)

    # --- modules ---
    def watch(self, modules: list[str] | None) -> None:
        named = dict(self.model.named_sublayers())
        for name in modules if modules is not None else list(named):
            rule = self.rule("modules", name)
            self._module_rules[name] = rule
            if rule.kind == "not_captured":
                self.not_captured["module." + name] = rule.why
                continue
            for source in rule.sources:
                if source not in named:
                    self.not_captured["module." + name] = f"the model has no sublayer {source!r}"
                    break
                self._hook(source, named[source], want_input=rule.kind == "input_of")

    def _hook(self, path: str, layer, want_input: bool) -> None:
        if (path, want_input) in self._hooked:
            return
        self._hooked.add((path, want_input))
        self._seen.setdefault(path, {})
        if want_input:
            self._handles.append(layer.register_forward_pre_hook(
                lambda _layer, inputs, path=path: self._store(path, "input", inputs[0])))
        else:
            self._handles.append(layer.register_forward_post_hook(
                lambda _layer, _inputs, output, path=path: self._store(
                    path, "output", output[0] if isinstance(output, (tuple, list)) else output)))

    def _store(self, path: str, what: str, tensor) -> None:
        if not self._seen[path]:
            self.ran.append(path)
        if what in self._seen[path]:
            self._seen[path]["_repeated"] = True
        self._seen[path][what] = to_host(tensor)
        self._seen[path].setdefault("_order", len(self._seen))

    def _module_array(self, name: str, rule) -> np.ndarray | None:
        parts, why = module_sources(self._seen, rule, word="sublayer")
        if why:
            self.not_captured["module." + name] = why
            return None
        parts = [self._drop_batch(part) for part in parts]
        if rule.kind == "deinterleave":  # one part of a fused sublayer's output (q of qkv_proj), on the last dim
            return apply_rule(rule, parts, axis=-1)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def _drop_batch(self, array: np.ndarray) -> np.ndarray:
        if self.batch_dim is not None and array.ndim >= 3 and array.shape[self.batch_dim] == 1:
            return np.squeeze(array, axis=self.batch_dim)
        return array

    def finish(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, rule in self._module_rules.items():
            if rule.kind != "not_captured":
                array = self._module_array(name, rule)
                if array is not None:
                    self._keep("module." + name, array)

    # --- gradients ---
    def grads(self, names: list[str] | None) -> None:
        params = dict(self.model.named_parameters())
        for name in names if names is not None else list(params):
            rule = self.rule("grads", name)
            sources = []
            for source in rule.sources:
                if source not in params:
                    raise KeyError(f"gradient {name!r}: the model has no parameter {source!r} (rule {rule.kind})")
                grad = params[source].grad
                if grad is None:
                    self.zero_grads.append(source)
                    sources.append(np.zeros(params[source].shape, dtype=to_host(params[source]).dtype))
                else:
                    sources.append(to_host(grad))
            self._keep("grad." + name, apply_rule(rule, sources))


def apply_rule(rule, sources: list[np.ndarray], axis: int = 0) -> np.ndarray:
    """A canonical tensor from the framework tensors its rule names, or (a checkpoint rule) a framework tensor from
    canonical ones: exact, copies only, never arithmetic. `axis`: where the interleave kinds interleave (0: weights
    and gradients; -1: module outputs)."""
    if rule.kind in ("interleave", "transpose_interleave"):
        fused = np.take(np.concatenate(sources, axis=axis), rule.rows(), axis=axis)
        return np.swapaxes(fused, -1, -2) if rule.kind == "transpose_interleave" else fused
    if rule.kind in ("deinterleave", "transpose_deinterleave"):
        fused = np.swapaxes(sources[0], -1, -2) if rule.kind == "transpose_deinterleave" else sources[0]
        return np.take(fused, rule.rows(rule.index), axis=axis)
    if rule.kind == "same":
        return sources[0]
    if rule.kind == "transpose":
        return np.swapaxes(sources[0], -1, -2)
    if rule.kind == "slice":
        return sources[0][rule.index]
    if rule.kind == "cat0":
        return np.concatenate(sources, axis=0)
    if rule.kind == "transpose_cat0":
        return np.concatenate([np.swapaxes(s, -1, -2) for s in sources], axis=0)
    if rule.kind == "cat0_transpose":
        return np.swapaxes(np.concatenate(sources, axis=0), -1, -2)
    if rule.kind == "cat_last":
        return np.concatenate(sources, axis=-1)
    raise ValueError(f"rule {rule.kind!r} does not apply to gradients")


def write(tensors: dict[str, np.ndarray], path, order: list[str] | None = None) -> None:
    """safetensors through Paddle, so bf16 (held as uint16 bits) is written as bf16; `order` (the capture order)
    goes in the file's metadata."""
    from safetensors.paddle import save_file

    out = {}
    for name, array in tensors.items():
        tensor = paddle.to_tensor(array, place=paddle.CPUPlace())
        out[name] = tensor.reshape([]) if array.ndim == 0 else tensor
    save_file(out, str(path), metadata={"order": json.dumps([n for n in (order or tensors) if n in tensors])})


@contextmanager
def capture(model, path, *, name_map=None, modules: list[str] | None = None, grads: list[str] | None = None,
            batch_dim: int | None = 0):
    cap = Capture(model, name_map, batch_dim)
    cap.watch(modules)
    try:
        yield cap
    except BaseException:
        cap.finish()
        raise
    cap.finish()
    start = time.perf_counter()
    cap.grads(grads)
    if path is not None:
        write(cap.tensors, path, cap.order)
    cap.write_seconds = round(time.perf_counter() - start, 6)


# --- per-module re-feed (harness.capture: REFEED_FILE); the same as harness.capture.torch.Refeed --------------------

def _substitute():
    from paddle.autograd import PyLayer

    class Substitute(PyLayer):
        """Forward: side a's value (``box[0]``, None: the local one) in place of the local tensor; backward: side
        a's gradient (``box[1]``, None: the incoming one) to the local tensor, the incoming one handed to ``box[2]``.
        The graph stays whole. The gradient is replaced here, not by a tensor hook: Paddle 3.3.1 calls a hook on a
        PyLayer's output but ignores what it returns (measured)."""

        @staticmethod
        def forward(ctx, local, box):
            ctx.box = box
            return (local if box[0] is None else box[0]).clone()

        @staticmethod
        def backward(ctx, grad):
            if ctx.box[2] is not None:
                ctx.box[2](grad)
            return grad if ctx.box[1] is None else ctx.box[1].astype(grad.dtype)

    return Substitute


class Refeed(RefeedBook):
    """Hooks for one re-feed run (see harness.capture.torch.Refeed): register after ``capture`` so its hooks see
    the local tensors (Paddle runs hooks in registration order, each one's result feeding the next)."""

    def __init__(self, model, units: dict[str, list[str]], mode: str, source=None, batch_dim: int = 0,
                 keep_output=("lm_head",), arguments: dict | None = None):
        from safetensors.paddle import load_file

        super().__init__(mode, batch_dim, keep_output, load_file(str(source)) if mode == "replay" else {}, arguments)
        self.substitute = _substitute()

        def hook(unit, index, parts, layer):
            self._handles.append(layer.register_forward_pre_hook(self._pre(unit, index)))
            self._handles.append(layer.register_forward_post_hook(self._post(unit, index, parts)))
        self.hook_units(units, dict(model.named_sublayers()), "sublayer", hook)

    def _canonical(self, tensor) -> np.ndarray:
        array = to_host(tensor)
        if array.ndim >= 3 and array.shape[self.batch_dim] == 1:
            array = np.squeeze(array, axis=self.batch_dim)
        return array

    def _fit(self, key: str, unit: str, index: int, parts: int, local, what: str):
        value = self.fitted(key, unit, index, parts, local, what)
        return None if value is None else value.reshape(local.shape).to(local.place)

    def _pre(self, unit: str, index: int):
        def hook(_layer, inputs):
            if not self.first_call(unit, index, "sublayer"):
                return None
            inputs, changed = list(inputs), False
            for at, name in enumerate(self.arguments_of(unit)[:len(inputs)]):  # positional: Paddle's pre-hooks
                x = inputs[at]
                if not isinstance(x, paddle.Tensor) or not x.is_floating_point():
                    continue  # token ids: the same checkpoint tensor on both sides
                key = input_key(unit, name)
                if index == 0:
                    self.tensors[key] = self._canonical(x)
                if self.mode != "replay":
                    continue
                value = self._fit(key, unit, 0, 1, x, name)
                if value is None:
                    continue
                self.note(unit, name)
                inputs[at] = self.substitute.apply(x, [value, None, None])
                changed = True
            return tuple(inputs) if changed else None
        return hook

    def _post(self, unit: str, index: int, parts: int):
        def hook(_layer, _inputs, output):
            if self.calls.get((unit, index), 0) > 1:
                return None
            y = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(y, paddle.Tensor) or not y.is_floating_point():
                self.not_refed[unit] = "its output is no floating-point tensor"
                return None
            if self.mode != "replay":
                self.parts.setdefault(self.keys[1] + unit, {})[index] = self._canonical(y)
                if not y.stop_gradient:
                    y.register_hook(lambda g: self.parts.setdefault(self.keys[2] + unit, {}).__setitem__(
                        index, self._canonical(g)))
                return None
            value = None if unit in self.keep_output else self._fit(self.keys[1] + unit, unit, index, parts, y,
                                                                    "output")
            grad = None if y.stop_gradient else self._fit(self.keys[2] + unit, unit, index, parts, y,
                                                          "output gradient")
            if value is None and grad is None:
                return None

            def keep(g, key=self.keys[2] + unit):  # the local gradient (the code after the unit made it)
                self.parts.setdefault(key, {})[index] = self._canonical(g)
            new = self.substitute.apply(y, [value, grad, keep if grad is not None else None])
            for what, given in (("output", value), ("output gradient", grad)):
                if given is not None:
                    self.note(unit, what)
            return type(output)([new, *output[1:]]) if isinstance(output, (tuple, list)) else new
        return hook

    def finish(self) -> dict[str, np.ndarray]:
        """The arrays to write (record: side a's inputs, outputs, output gradients; replay: the local inputs and the
        local gradients that arrived at each unit's output before side a's replaced them)."""
        return self.joined(lambda parts: np.concatenate(parts, axis=-1))
