"""The Paddle runner's kernel guard: a kernel the framework says is missing becomes UNSUPPORTED naming it (and the
CPU); anything else is raised, so the cell is an ERROR with its traceback (docs/unsupported.md). Every level calls its
forward and backward through it (the `guard` argument). Standard library only: it never imports paddle."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

from harness.run.protocol import Unsupported, cpu_isa_flags


def kernel_guard(call, kernel: str, request):
    """A kernel the framework says is missing becomes UNSUPPORTED naming it (and the CPU); anything else is raised,
    which makes the cell an ERROR with its traceback.

    Missing, as the framework says it: Paddle's "(NotFound) ... kernel ... is not registered"; or, for a bf16 oneDNN
    graph on a CPU where oneDNN has no AVX-512 (its bf16 matmul needs avx512_core), oneDNN's ``dnnl::error``. Paddle
    raises that one as a bare ``RuntimeError('std::exception')`` and names it only in its log on stderr
    ("onednn_op.matmul raises an exception dnnl::error"; measured with paddle 3.3.1 and ``ONEDNN_MAX_CPU_ISA=AVX2``),
    so the guard reads what the call wrote to stderr (and passes it on unchanged)."""
    said = _StderrCopy()
    try:
        with said:
            return call()
    except Exception as error:  # Paddle raises bare RuntimeError/NotFoundError from C++
        missing = _missing_kernel(error, said.text, kernel, request)
        if missing is None:
            raise
        raise Unsupported(missing) from error


def _missing_kernel(error: Exception, stderr: str, kernel: str, request) -> str | None:
    """The UNSUPPORTED reason when `error` is the framework saying a kernel is missing, else None."""
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    where = f"{kernel} on {request['device']} in {request['dtype']}: {message}"
    if "not registered" in text:
        return where
    onednn = next((line.split("] ", 1)[-1].strip() for line in stderr.splitlines() if "dnnl::error" in line), None)
    if onednn and request["device"] == "cpu" and request["dtype"] == "bfloat16" and not _onednn_avx512():
        isa = cpu_isa_flags()
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return (f"{where} (Paddle's log: {onednn}). oneDNN's bf16 matmul needs AVX-512 (avx512_core; native with "
                f"avx512_bf16); this CPU has {' '.join(isa) or 'no listed vector ISA'}"
                + (f", and oneDNN is capped at ONEDNN_MAX_CPU_ISA={cap}" if cap else ""))
    return None


# oneDNN ISA caps below AVX-512 (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA values)
_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


def _onednn_avx512() -> bool:
    """Whether oneDNN may use AVX-512 here: the CPU has it and no ISA cap in the environment takes it away."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    return "avx512f" in cpu_isa_flags() and cap not in _BELOW_AVX512


class _StderrCopy:
    """What the block writes to file descriptor 2 (C++ logs included), kept in `text` and passed on to the real
    stderr when the block ends."""

    def __init__(self):
        self.text = ""

    def __enter__(self):
        _flush_stdio()
        self._saved = os.dup(2)
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        _flush_stdio()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        data = self._file.read()
        self._file.close()
        self.text = data.decode("utf-8", "replace")
        while data:
            data = data[os.write(2, data):]
        return False


def _flush_stdio() -> None:
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (Paddle's glog) belong to the block that wrote them
    except (OSError, AttributeError):
        pass
