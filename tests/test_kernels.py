"""Parsing oneDNN's verbose log (format of oneDNN 3.x as printed by torch and Paddle)."""

from harness.run.kernels import onednn_kernels

LOG = """\
onednn_verbose,v1,info,oneDNN v3.6.2 (commit 2eb3dd1082db767fab171e934c551c609008289a)
onednn_verbose,v1,primitive,create:cache_miss,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab,,,16x64:64x32,0.1
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab,,,16x64:64x32,0.05
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab,,,16x64:64x32,0.04
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:ab::f0 dst:bf16:ba,,,64x32,0.01
some other line
"""


def test_executed_kernels_are_listed_once_in_order(tmp_path):
    log = tmp_path / "stdout.log"
    log.write_text(LOG)
    assert onednn_kernels(log) == ["matmul brg_matmul:avx512_core_amx 16x64:64x32", "reorder jit:uni 64x32"]


def test_missing_log_gives_no_kernels(tmp_path):
    assert onednn_kernels(tmp_path / "absent.log") == []
