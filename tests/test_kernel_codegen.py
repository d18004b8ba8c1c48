"""What the LoRA shrink compiles to for an H100/H200 (sm90), checked on the CPU.

Triton's NVIDIA backend emits PTX without a GPU. A K split whose start Triton
cannot prove aligned makes every x and A load of the shrink a 2-byte
``ld.global.b16``, with no async pipelining of its K loop: 2-3x slower at
prefill sizes on an H200 (benchmarks/RESULTS.md). The compile runs in a
subprocess because the interpreter tests of this suite set TRITON_INTERPRET=1
in this process.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Compiles the shrink and the one-launch kernel with the argument facts Triton
# derives at launch on the Llama-3-8B qkv shape: pointers and the K sizes and
# strides divisible by 16, unit strides constant; the batch ints and k_per_split
# are not specialized (do_not_specialize), so they carry no divisibility.
SCRIPT = r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from loraserve.kernels import lora_one_launch, lora_shrink

ptr_types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
             "flag_ptr": "*i32", "sorted_ids_ptr": "*i32", "slot_start_ptr": "*i32",
             "slot_count_ptr": "*i32", **{f"{m}{i}_ptr": "*bf16" for m in "ab" for i in range(3)}}
aligned = {"K", "R", "stride_xm", "stride_as", "stride_ar", "stride_bn", "stride_ym",
           "n0", "n1", "n2", "yo0", "yo1", "yo2", "sbs0", "sbs1", "sbs2"}
consts = dict(NUM_SLICES=3, PROGRAM_SLICES=1, SPLIT_K=2, BLOCK_M=64, BLOCK_K=128, BLOCK_N=128,
              BLOCK_R=16, BLOCK_S=32, EVEN_K=True, ALIGN=8, PRECISION="tf32", DOT_FP32=False,
              N_ITERS=1, stride_xk=1, stride_ak=1, stride_br=1, stride_yn=1)
out = {}
for module, name in ((lora_shrink, "_lora_shrink_kernel"),
                     (lora_one_launch, "_lora_one_launch_kernel")):
    fn = getattr(module, name)
    names = fn.arg_names
    sig = {n: ptr_types.get(n, "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(
        fn=fn, signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items() if n in names},
        attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in ptr_types or n in aligned},
    )
    ptx = compile(src, target=GPUTarget("cuda", 90, 32),
                  options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    out[name] = {
        "b16_loads": len(re.findall(r"ld\.global(\.[a-z]+)*\.b16", ptx)),
        "async_copies": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
    }
print(json.dumps(out))
"""


def compile_report(script: str) -> dict:
    """Run a compile script with the real compiler; its last line is a JSON report."""
    compiled = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=compiled, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_shrink_loads_are_vectorized_and_pipelined_on_sm90():
    counts = compile_report(SCRIPT)
    for name, c in counts.items():
        assert c["b16_loads"] == 0, f"{name}: {c['b16_loads']} 2-byte global loads"
        assert c["async_copies"] > 0, f"{name}: its K loop is not pipelined (no cp.async)"


# The decode GEMM with PDL, on the Llama-3-8B o_proj shape with split-K, plain and
# with SiLU-and-mul in its epilogue (gate/up).
DENSE_SCRIPT = r"""
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from loraserve.kernels import dense_gemm


def report(fn, ptrs, aligned, consts):
    names = fn.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                           if n in ptrs or n in aligned})
    ptx = compile(src, target=GPUTarget("cuda", 90, 32),
                  options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    before_wait, _, after_wait = ptx.partition("griddepcontrol.wait")
    return {
        "b16_loads": len(re.findall(r"ld\.global(\.[a-z]+)*\.b16", ptx)),
        "async_copies": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", after_wait)),
        "launch_dependents": before_wait.count("griddepcontrol.launch_dependents"),
        "prefetches_before_wait": before_wait.count("prefetch.global.L2"),
        "loads_before_wait": len(re.findall(r"ld\.global|cp\.async", before_wait)),
        "stores_before_wait": len(re.findall(r"st\.global|atom\.", before_wait)),
    }


out = {}
for silu in (False, True):
    out[f"dense_silu_{silu}"] = report(
        dense_gemm._dense_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
         "ws_ptr": "*fp32", "lock_ptr": "*i32"},
        {"N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ym"},
        dict(SILU_MUL=silu, HAS_BIAS=False, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4,
             EVEN_K=True, EVEN_N=True, PRECISION="tf32", PDL=True, PREFETCH_K=512))
print(json.dumps(out))
"""


def test_decode_gemm_prefetches_weights_before_the_pdl_wait_and_nothing_else():
    report = compile_report(DENSE_SCRIPT)
    for name, c in report.items():
        assert c["launch_dependents"] == 1 and c["prefetches_before_wait"] > 0, (name, c)
        # Reads of activations and every write wait for the previous kernel.
        assert c["loads_before_wait"] == 0 and c["stores_before_wait"] == 0, (name, c)
        assert c["b16_loads"] == 0 and c["async_copies"] > 0, (name, c)
