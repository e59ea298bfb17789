"""Compile every kernel variant for sm_90 and print one JSON line per variant.

Run as a script with TRITON_INTERPRET unset (under the interpreter the kernels are not
JIT functions). ``tests/test_compile.py`` runs it in a subprocess.
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tfuture.kernels.resolve import _prepare_kernel, _resolve_kernel
from tfuture.kernels.store import _store_kernel

SM90 = GPUTarget("cuda", 90, 32)


def variants():
    for ids in ("*i32", "*i64"):
        for has_err in (True, False):
            sig = {"ids_ptr": ids, "map_ptr": "*i64", "err_ptr": "*i64", "n_ids": "i32", "n_slots": "i32"}
            yield (
                f"resolve-{ids[1:]}-err{int(has_err)}",
                _resolve_kernel,
                sig,
                {"BLOCK": 1024, "HAS_ERR": has_err},
            )
    for contiguous in (True, False):
        for has_err in (True, False):
            sig = {"map_ptr": "*i64", "slots_ptr": "*i32", "values_ptr": "*i32", "err_ptr": "*i64"}
            sig |= {"n_values": "i32", "n_slots": "i32", "slot_start": "i32"}
            const = {"BLOCK": 256, "CONTIGUOUS": contiguous, "HAS_ERR": has_err}
            yield f"store-contig{int(contiguous)}-err{int(has_err)}", _store_kernel, sig, const
    for steps in (0, 1, 12):
        sig = {name: "*i64" for name in ("tokens_ptr", "seg_ptr", "prefix_ptr", "map_ptr")}
        sig |= {"ids_out_ptr": "*i32", "pos_out_ptr": "*i64", "last_out_ptr": "*i64", "err_ptr": "*i64"}
        sig |= {name: "i32" for name in ("n_tokens", "n_reqs", "n_rows", "n_slots")}
        yield (
            f"prepare-steps{steps}",
            _prepare_kernel,
            sig,
            {"BLOCK": 1024, "SEARCH_STEPS": steps, "HAS_ERR": True},
        )


def main() -> int:
    for name, fn, sig, const in variants():
        try:
            ptx = triton.compile(
                ASTSource(fn, sig | dict.fromkeys(const, "constexpr"), const), target=SM90
            ).asm["ptx"]
            row = {"name": name, "ok": True, "atomics": ptx.count("atom."), "stores": ptx.count("st.global")}
        except Exception as exc:  # reported, the test decides
            row = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
