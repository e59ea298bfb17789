"""Compile every kernel variant for sm_90 and print one JSON line per variant.

Run as a script with TRITON_INTERPRET unset (under the interpreter the kernels are not JIT
functions, and Triton 3.9's compiler rejects the fields kernel there). ``test_compile.py``
runs it in a subprocess.
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tfuture.kernels.fields import _fields_kernel
from tfuture.kernels.resolve import _prepare_kernel, _resolve_kernel
from tfuture.kernels.spec import _spec_prepare_kernel
from tfuture.kernels.store import _store_kernel

SM90 = GPUTarget("cuda", 90, 32)


def _fields_variants():
    sig = {"slots_ptr": "*i64", "src_ptrs": ("*i64", "*i16"), "dst_ptrs": ("*i64", "*i16")}
    sig |= {"src_strides": ("i64", "i64"), "dst_strides": ("i64", "i64"), "err_ptr": "*i64"}
    sig |= {"n_rows": "i32", "n_slots": "i32", "slot_start": "i32"}
    for gather in (True, False):
        for contiguous, has_err in ((False, True), (True, False)):
            const = {"WIDTHS": (4, 1030), "BLOCK_C": (4, 512), "CHUNKS": (1, 3), "BLOCK_R": 8}
            const |= {
                "GATHER": gather,
                "CONTIGUOUS": contiguous,
                "NEGATED": not contiguous,
                "HAS_ERR": has_err,
            }
            yield f"fields-gather{int(gather)}-contig{int(contiguous)}-err{int(has_err)}", sig, const
    # Zero-width fields only: err stands in for the buffers and the launch only flags bad slots.
    sig = sig | {
        "src_ptrs": ("*i64",),
        "dst_ptrs": ("*i64",),
        "src_strides": ("i64",),
        "dst_strides": ("i64",),
    }
    const = {"WIDTHS": (0,), "BLOCK_C": (1,), "CHUNKS": (0,), "BLOCK_R": 4}
    const |= {"GATHER": False, "CONTIGUOUS": False, "NEGATED": False, "HAS_ERR": True}
    yield "fields-zero-width-err1", sig, const


def variants():
    for ids in ("*i32", "*i64"):
        for has_err in (True, False):
            sig = {"ids_ptr": ids, "map_ptr": "*i64", "err_ptr": "*i64", "n_ids": "i32", "n_slots": "i32"}
            const = {"BLOCK": 1024, "HAS_ERR": has_err}
            yield f"resolve-{ids[1:]}-err{int(has_err)}", _resolve_kernel, sig, const
    for contiguous in (True, False):
        for has_err in (True, False):
            sig = {"map_ptr": "*i64", "slots_ptr": "*i32", "values_ptr": "*i32", "err_ptr": "*i64"}
            sig |= {"n_values": "i32", "n_slots": "i32", "slot_start": "i32"}
            const = {"BLOCK": 128, "CONTIGUOUS": contiguous, "HAS_ERR": has_err}
            yield f"store-contig{int(contiguous)}-err{int(has_err)}", _store_kernel, sig, const
    for steps in (0, 1, 12):
        sig = {name: "*i64" for name in ("tokens_ptr", "seg_ptr", "prefix_ptr", "map_ptr")}
        sig |= {"ids_out_ptr": "*i32", "pos_out_ptr": "*i64", "last_out_ptr": "*i64", "err_ptr": "*i64"}
        sig |= {name: "i32" for name in ("n_tokens", "n_reqs", "n_rows", "n_slots")}
        const = {"BLOCK": 1024, "SEARCH_STEPS": steps, "HAS_ERR": True}
        yield f"prepare-steps{steps}-err1", _prepare_kernel, sig, const
    for name, sig, const in _fields_variants():
        yield name, _fields_kernel, sig, const
    names = ["last_ptr", "lens_ptr", "tokens_ptr", "accept_ptr", "seq_ptr", "draft_ptr"]
    names += ["ids_out_ptr", "pos_out_ptr", "ndraft_out_ptr", "err_ptr"]
    sig = dict.fromkeys(names, "*i64") | {"accept_ptr": "*i32"}
    sig |= {"n_reqs": "i32", "n_rows": "i32", "n_slots": "i32"}
    for k, has_err in ((3, True), (0, False)):
        const = {"N_TOK": k + 1, "K": k, "BLOCK_R": 16, "BLOCK_W": triton.next_power_of_2(k + 1)}
        yield f"spec-k{k}-err{int(has_err)}", _spec_prepare_kernel, sig, const | {"HAS_ERR": has_err}


def main() -> int:
    for name, fn, sig, const in variants():
        try:
            src = ASTSource(fn, sig | dict.fromkeys(const, "constexpr"), const)
            ptx = triton.compile(src, target=SM90).asm["ptx"]
            loads = ptx.count("ld.global")
            row = {"name": name, "ok": True, "atomics": ptx.count("atom."), "stores": ptx.count("st.global")}
            row["loads"] = loads
        except Exception as exc:  # reported, the test decides
            row = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
