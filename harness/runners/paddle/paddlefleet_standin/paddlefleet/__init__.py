"""A stand-in for PaddleFleet: NOT the real package. It exists only so that PaddleFormers 1.2.0's dygraph model
modules import on a CPU (harness/runners/paddle/paddlefleet_shim.py puts it on ``sys.path`` for that import alone).

``paddleformers/transformers/glm4_moe/modeling.py`` (and ``qwen3_moe/modeling.py``) import ``gpt_provider`` for their
PaddleFleet builders, and ``gpt_provider`` / ``model_provider`` raise ImportError unless
``importlib.util.find_spec("paddlefleet")`` finds a package with a location, then import the names below at module
level. The dygraph ``*Deprecated`` classes the harness runs never use any of them. So every name here is an
import-time placeholder: a function that records its call and raises, a class that records its construction and
raises, or a constant that PaddleFormers reads while defining its classes (``GPTConfig.transform_rules``,
``ModelType``). ``CALLS`` lists every call; ``tests/test_glm4_moe.py`` shows that a whole run leaves it empty.
"""

CALLS: list[str] = []


class StandInUsed(RuntimeError):
    """A stand-in name was called: the path needs the real PaddleFleet."""


def refuse(name: str):
    """A placeholder function: records the call in ``CALLS`` and raises."""
    def call(*args, **kwargs):
        CALLS.append(name)
        raise StandInUsed(f"paddlefleet stand-in (harness): {name} was called; this path needs the real PaddleFleet")
    call.__name__ = call.__qualname__ = name.rsplit(".", 1)[-1]
    return call


class Placeholder:
    """A placeholder class: subclassing it is what PaddleFormers does at import time; constructing it records the call
    in ``CALLS`` and raises."""

    def __init__(self, *args, **kwargs):
        CALLS.append(f"{type(self).__module__}.{type(self).__qualname__}")
        raise StandInUsed(f"paddlefleet stand-in (harness): {type(self).__qualname__} was constructed; this path "
                          "needs the real PaddleFleet")
