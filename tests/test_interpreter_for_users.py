"""``TRITON_INTERPRET=1`` alone lets a user run the kernels on CPU tensors: no setup call, no conftest.

The Triton 3.6 interpreter cannot run loops with runtime bounds under numpy >= 2.4 without
``fix_interpreter_index``; the op bodies apply it at their first interpreted launch. Each test runs
a fresh interpreter process (this process has the test tiers' own setup), and checks that importing
tritune patches nothing: only a launch on the interpreter does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_SCRIPT = """
import torch
from triton.runtime import interpreter

import tritune.kernels.decode.kernel
import tritune.kernels.prefill.kernel
import tritune.kernels.q4k.kernel
import tritune.kernels.varlen.kernel
from tritune.kernels import (
    Q4KWeight, attention, decode_attention, prefill_attention, q4k_linear, varlen_attention,
)
from tritune.kernels._numerics import compare
from tritune.kernels.decode.reference import decode_reference
from tritune.kernels.prefill.reference import prefill_reference
from tritune.kernels.q4k.reference import q4k_linear_reference, sqnr_db
from tritune.kernels.varlen.reference import varlen_reference


def patched():
    return bool(getattr(interpreter._patch_lang_tensor, "_tritune_index_fix", False))


print(f"after-import|{patched()}")
if LAUNCH:
    gen = torch.Generator().manual_seed(0)
    bf = lambda *shape: torch.randn(shape, generator=gen).to(torch.bfloat16)
    q, k, v = bf(1, 2, 3, 64), bf(1, 1, 9, 64), bf(1, 1, 9, 64)
    kv_len = torch.tensor([7], dtype=torch.int32)
    store_k, store_v = bf(9, 1, 1, 64), bf(9, 1, 1, 64)
    qv, info = bf(3, 2, 64), torch.tensor([[0, 3, 0, 7]], dtype=torch.int32)
    weight = Q4KWeight.quantize(torch.randn(16, 256, generator=gen))
    x = bf(2, 256)
    ref = prefill_reference(q, k, v, kv_len=kv_len, dtype=torch.float64)
    checks = {
        "prefill_attention": lambda: compare(prefill_attention(q, k, v, kv_len=kv_len), ref, q.dtype),
        "decode_attention": lambda: compare(
            decode_attention(q, k, v, kv_len), decode_reference(q, k, v, kv_len), q.dtype
        ),
        "attention": lambda: compare(attention(q, k, v, kv_len=kv_len), ref, q.dtype),
        "varlen_attention": lambda: compare(
            varlen_attention(qv, store_k, store_v, info), varlen_reference(qv, store_k, store_v, info), q.dtype
        ),
        "q4k_linear": lambda: None
        if sqnr_db(q4k_linear(x, weight).float(), q4k_linear_reference(x, weight)) >= 25.0
        else "SQNR below 25 dB",
    }
    for name, check in checks.items():
        try:
            problem = check()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"{name}|{problem or 'ok'}")
    print(f"after-launch|{patched()}")
"""


def _run(tmp_path, *, interpret: bool, launch: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", TRITUNE_DB=str(tmp_path / "configs.sqlite"), TRITUNE_DISABLE_BUNDLES="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    script = _SCRIPT.replace("LAUNCH", str(launch))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(line.split("|", 1) for line in run.stdout.splitlines() if "|" in line)


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch.library.wrap_triton refuses interpreted kernels before torch 2.13",
)
def test_the_kernels_run_on_cpu_tensors_with_only_triton_interpret_set(tmp_path):
    results = _run(tmp_path, interpret=True, launch=True)
    assert results.pop("after-import") == "False", "importing tritune must not patch the interpreter"
    assert results.pop("after-launch") == "True"
    assert results == dict.fromkeys(
        ["prefill_attention", "decode_attention", "attention", "varlen_attention", "q4k_linear"], "ok"
    )


def test_importing_without_the_interpreter_patches_nothing(tmp_path):
    assert _run(tmp_path, interpret=False, launch=False) == {"after-import": "False"}
