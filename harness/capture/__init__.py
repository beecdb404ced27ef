"""Capture APIs, one module per framework (``torch``, ``paddle``) with the same small interface: module outputs by
forward hooks and parameter gradients, written in the canonical names of docs/model-contract.md, around any training
step. Each imports only its own framework, safetensors and ``harness.case.models`` (standard library), so a runner or
a user's own training script can import it without the rest of the harness. See ``harness/capture/torch.py``."""


def module_sources(seen: dict[str, dict], rule, word: str = "module") -> tuple[list, str | None]:
    """The tensors a canonical module output is made of (its rule's sources, as hooks stored them in `seen`), or
    why it cannot be had: a source that did not run, or ran more than once in the step. Framework-free: both
    capture modules share it and only drop the batch dim and concatenate in their own framework."""
    what = "input" if rule.kind == "input_of" else "output"
    parts = []
    for source in rule.sources:
        stored = seen.get(source, {})
        if stored.get("_repeated"):
            return [], f"{word} {source!r} ran more than once in the step"
        if what not in stored:
            return [], f"{word} {source!r} did not run"
        parts.append(stored[what])
    return parts, None
