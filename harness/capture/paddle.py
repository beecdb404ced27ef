"""Capture a Paddle dygraph model's module outputs and parameter gradients in canonical names (imports paddle).

    name_map = load_name_map(MODEL_MAP, "paddle")
    with capture(model, path, name_map=name_map, layers=2, experts=384) as cap:
        out = model(input_ids, labels=labels)
        cap.add("logits", out.logits[0])
        cap.add("loss", out.loss)
        out.loss.backward()
    # on leaving the block: every parameter's .grad, in canonical names and layout, and everything above -> path

Module outputs are observed by forward hooks on the sublayers the name map names (a post-hook's output, or a
pre-hook's first input: what enters that sublayer), copied to host memory at once. Nothing is recomputed: a module
the map cannot reach is left out, and `cap.not_captured` says why. Layout changes only (batch dim dropped,
transposes, concatenation, scattering the router's top-k weights into `[T, experts]`): no arithmetic.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import paddle
import tomllib

MODELS_DIR = Path(__file__).resolve().parents[1] / "case" / "models"


def load_name_map(path: str | Path, framework: str) -> dict:
    """One framework's section of a model's name map (harness/case/models/*.toml)."""
    document = tomllib.loads(Path(path).read_text())
    if framework not in document:
        raise KeyError(f"{path}: no [{framework}] section (sections: {', '.join(document)})")
    return document[framework]


def expand(pattern: str, layers: int, experts: int) -> list[tuple[dict, str]]:
    """Every concrete name of a `{L}`/`{E}` pattern, with the indices used."""
    names = [({}, pattern)]
    for key, count in (("L", layers), ("E", experts)):
        if "{" + key + "}" in pattern:
            names = [({**idx, key: i}, name.replace("{" + key + "}", str(i))) for idx, name in names
                     for i in range(count)]
    return names


def fill(template: str, indices: dict) -> str:
    for key, value in indices.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def pattern_regex(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(f"^{escaped}$")


def to_host(tensor) -> np.ndarray:
    """A host copy of a tensor as numpy (bf16 comes back as its uint16 bits, as `Tensor.numpy()` gives it)."""
    return np.array(tensor.detach().cpu().numpy(), copy=True)


class Capture:
    def __init__(self, model, name_map: dict, layers: int, experts: int):
        self.model = model
        self.name_map = name_map
        self.layers, self.experts = layers, experts
        self.sublayers = dict(model.named_sublayers())
        self.parameters = dict(model.named_parameters())
        self.tensors: dict[str, np.ndarray] = {}
        self.order: list[str] = []
        self.not_captured: dict[str, str] = {}
        self._handles = []
        self._pending: dict[str, dict[str, np.ndarray]] = {}  # `cat` parts seen so far
        self.write_seconds = 0.0

    # -- module outputs -------------------------------------------------------------------------------------
    def install(self) -> None:
        for pattern, rule in self.name_map.get("modules", {}).items():
            for indices, canonical in expand(pattern, self.layers, self.experts):
                self._install_one("module." + canonical, indices, rule)

    def _install_one(self, name: str, indices: dict, rule: dict) -> None:
        if "requires" in rule and fill(rule["requires"], indices) not in self.sublayers:
            return
        if "cat" in rule:
            parts = [fill(p, indices) for p in rule["cat"]]
            if all(p in self.sublayers for p in parts):
                for part in parts:
                    self._post(self.sublayers[part], self._cat_hook(name, part, parts))
            return
        layer_name = fill(rule["layer"], indices)
        if layer_name not in self.sublayers:
            return
        layer, take = self.sublayers[layer_name], rule.get("take", "output")
        if take == "input":
            self._handles.append(layer.register_forward_pre_hook(
                lambda _layer, inputs, name=name: self._store(name, inputs[0])))
        elif take in ("topk_indices", "topk_probs"):
            self._post(layer, lambda _l, _i, out, name=name, take=take: self._router(name, take, out))
        elif "routed_only" in rule:
            router = "module." + fill(rule["routed_only"], indices) + ".topk_indices"
            self._post(layer, lambda _l, _i, out, name=name, router=router, e=indices["E"]:
                       self._store(name, out) if self._routed(router, e) else None)
        else:
            self._post(layer, lambda _l, _i, out, name=name: self._store(name, out))

    def _post(self, layer, hook) -> None:
        self._handles.append(layer.register_forward_post_hook(hook))

    def _cat_hook(self, name, part, parts):
        def hook(_layer, _inputs, output):
            seen = self._pending.setdefault(name, {})
            seen[part] = to_host(output)
            if len(seen) == len(parts):
                self._keep(name, np.concatenate([seen.pop(p) for p in parts], axis=-1))
        return hook

    def _router(self, name, take, output) -> None:
        indices, weights = (to_host(t) for t in output[:2])
        order = np.argsort(indices, axis=-1, kind="stable")
        if take == "topk_indices":
            self._keep(name, np.take_along_axis(indices, order, axis=-1).astype(np.int64))
        else:
            probs = np.zeros((indices.shape[0], self.experts), dtype=weights.dtype)
            np.put_along_axis(probs, indices, weights, axis=-1)
            self._keep(name, probs)

    def _routed(self, router_name: str, expert: int) -> bool:
        if router_name not in self.tensors:
            raise RuntimeError(f"{router_name} was not captured before the experts ran")
        return bool((self.tensors[router_name] == expert).any())

    def _store(self, name, tensor) -> None:
        self._keep(name, to_host(tensor))

    def _keep(self, name: str, array: np.ndarray) -> None:
        if array.ndim >= 3 and array.shape[0] == 1 and name.startswith("module."):
            array = array[0]  # [1, T, ...] -> [T, ...]; 2-D outputs (router, experts) are already [tokens, ...]
        if name in self.tensors:
            raise RuntimeError(f"{name} observed twice in one forward pass")
        self.tensors[name] = np.array(array, order="C", copy=True)  # (ascontiguousarray makes a 0-d array 1-d)
        self.order.append(name)

    def add(self, name: str, tensor) -> None:
        """A tensor the caller holds (logits, loss)."""
        self._keep(name, to_host(tensor))

    # -- gradients ------------------------------------------------------------------------------------------
    def gradients(self) -> None:
        for pattern, rule in self.name_map.get("grads", {}).items():
            for indices, canonical in expand(pattern, self.layers, self.experts):
                sources = rule["from"] if isinstance(rule["from"], list) else [rule["from"]]
                sources = [fill(s, indices) for s in sources]
                if not all(s in self.parameters for s in sources):
                    continue
                name = "grad." + canonical
                missing = [s for s in sources if self.parameters[s].grad is None]
                if missing:
                    self.not_captured[name] = f"Paddle left no gradient in {', '.join(missing)}"
                    continue
                parts = [to_host(self.parameters[s].grad) for s in sources]
                if rule.get("transpose"):
                    parts = [p.T for p in parts]
                grad = np.concatenate(parts, axis=0) if rule.get("cat0") else parts[0]
                self._keep(name, grad)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def write(tensors: dict[str, np.ndarray], path: str | Path, order: list[str] | None = None) -> None:
    """safetensors through Paddle, so bf16 (held as uint16 bits) is written as bf16; `order` goes in the metadata."""
    import json

    from safetensors.paddle import save_file

    out = {name: paddle.to_tensor(array, place=paddle.CPUPlace()) for name, array in tensors.items()}
    save_file(out, str(path), metadata={"order": json.dumps(order or list(tensors))})


@contextmanager
def capture(model, path: str | Path, *, name_map: dict, layers: int, experts: int, cast=None):
    """Hooks on while the block runs forward and backward; on a clean exit the gradients are collected and every
    captured tensor is written to `path` (`cast(name, array) -> array` may change a dtype first, e.g. an exact
    upcast)."""
    cap = Capture(model, name_map, layers, experts)
    cap.install()
    try:
        yield cap
    finally:
        cap.remove()
    start = time.perf_counter()
    cap.gradients()
    tensors = {name: cast(name, array) if cast else array for name, array in cap.tensors.items()}
    write(tensors, path, cap.order)
    cap.write_seconds = round(time.perf_counter() - start, 6)
