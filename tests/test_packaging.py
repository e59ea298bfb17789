"""The front door: the licence and ``py.typed`` ship in the wheel, a missing optional dependency
names the extra that installs it, every ``python -m`` entry point answers ``--help``, and the
docs name only modules that exist.

A missing dependency is simulated in a fresh interpreter (``sys.modules[name] = None`` makes
``import name`` raise), so this process's imports stay as they are.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def run_py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# --- licence and type information ----------------------------------------------------------


def test_license_is_apache_2_and_declared():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 the tfuture authors" in text
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}  # the form setuptools >= 61 takes


def test_py_typed_is_package_data():
    assert (ROOT / "tfuture" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["tfuture"]


def _setuptools_version() -> tuple[int, ...]:
    try:
        from importlib.metadata import version

        return tuple(int(p) for p in version("setuptools").split(".")[:2])
    except Exception:  # pragma: no cover - no setuptools in this environment
        return (0,)


@pytest.mark.skipif(_setuptools_version() < (77,), reason="the SPDX license string needs setuptools>=77")
def test_the_wheel_ships_license_py_typed_and_the_license_expression(tmp_path):
    """Build the wheel from a copy (the build leaves ``build/`` behind in its source tree)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "tfuture", src / "tfuture", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            ".",
        ],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("tfuture-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "tfuture/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "License: Apache-2.0" in meta.splitlines()


# --- a missing optional dependency names its extra -----------------------------------------

# In a fresh interpreter: block the modules in argv[1] (comma separated), run argv[2], print
# the exception it raised as JSON.
PROBE = """
import json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
try:
    exec(sys.argv[2])
except BaseException as e:
    print(json.dumps({"types": [c.__name__ for c in type(e).__mro__], "msg": str(e)}))
else:
    print(json.dumps(None))
"""


def probe(blocked: str, code: str) -> dict[str, object] | None:
    proc = run_py(PROBE, blocked, code)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] | None = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# tfuture installs from a clone (issue 30 item 14): the hints say so.
HF_CLONE = "from a clone of tfuture, pip install -e '.[hf]'"
GRAMMAR_CLONE = r"from a clone of tfuture, pip install -e '\.\[grammar\]'"


def test_tfuture_models_without_transformers_names_the_hf_extra():
    err = probe("transformers", "import tfuture.models")
    assert err is not None and "ModuleNotFoundError" in err["types"] and "ImportError" in err["types"]
    assert err["msg"] == (f"tfuture.models needs the 'hf' extra (transformers is not installed): {HF_CLONE}")
    err = probe("transformers", "from tfuture.models import HFCausalLM")
    assert err is not None and "needs the 'hf' extra" in str(err["msg"])


def test_the_core_package_imports_without_any_extra():
    assert (
        probe("transformers,xgrammar,tokenizers", "import tfuture, tfuture.grammars, tfuture.testing") is None
    )


def hf_main(*argv: str) -> str:
    """Code that runs ``python -m tfuture.examples.hf *argv``."""
    run = "runpy.run_module('tfuture.examples.hf', run_name='__main__')"
    return f"import runpy, sys; sys.argv = ['hf', *{list(argv)!r}]; {run}"


def test_the_hf_example_without_transformers_names_the_hf_extra():
    err = probe("transformers", hf_main())
    assert err is not None and "ModuleNotFoundError" in err["types"]
    assert (
        err["msg"] == f"tfuture.examples.hf needs the 'hf' extra (transformers is not installed): {HF_CLONE}"
    )
    err = probe("transformers", "from tfuture.examples.hf import build_llama; build_llama()")
    assert err is not None and err["msg"].endswith(HF_CLONE)  # type: ignore[union-attr]


def test_the_hf_example_relabels_only_a_missing_transformers():
    from tfuture.examples.hf import _no_transformers

    assert _no_transformers(ModuleNotFoundError("x", name="transformers"))
    assert _no_transformers(ModuleNotFoundError("x", name="transformers.models.llama"))
    assert not _no_transformers(ModuleNotFoundError("x", name="transformers_extra"))
    assert not _no_transformers(ModuleNotFoundError("x", name="safetensors"))
    assert not _no_transformers(ModuleNotFoundError("x"))


def test_xgrammar_adapter_without_xgrammar_names_the_grammar_extra():
    """The module imports without xgrammar (it is imported on first use); first use raises."""
    err = probe("xgrammar", "from tfuture.grammars.xgrammar import tokenizer_info; tokenizer_info(None)")
    assert err is not None and "ImportError" in err["types"]
    assert re.search(GRAMMAR_CLONE, str(err["msg"])), err["msg"]


def test_tokenizer_helper_without_tokenizers_names_the_grammar_extra():
    err = probe("tokenizers", "from tfuture.testing.tokenizer import train_bpe; train_bpe(['a b'])")
    assert err is not None and "ImportError" in err["types"]
    assert re.search(GRAMMAR_CLONE, str(err["msg"])), err["msg"]


# --- every python -m entry point answers --help --------------------------------------------

ENTRY_POINTS = {
    # module: what its --help must mention (options and words of its description)
    "tfuture.testing.demo": [
        "--t-dev",
        "--ratios",
        "--batch",
        "--steps",
        "--tp",
        "--pp",
        "overlapped workload",
    ],
    "tfuture.testing.demo_parallel": ["torchrun", "tfuture.testing.demo", "--tp", "--pp"],
    "tfuture.examples.hf": ["--requests", "--max-new", "--host-ms", "--trace", "Hugging Face Llama"],
    "perf": ["--refresh", "BENCH", "every benchmark"],
}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_entry_point_help(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout[:200]
    for word in ENTRY_POINTS[module]:
        assert word in proc.stdout, f"{module} --help does not mention {word!r}"


def test_the_hf_example_help_works_without_transformers():
    proc = run_py(f"import sys; sys.modules['transformers'] = None; exec({hf_main('--help')!r})")
    assert proc.returncode == 0, proc.stderr
    assert "--requests" in proc.stdout


def test_demo_parallel_run_directly_points_at_the_demo():
    proc = subprocess.run(
        [sys.executable, "-m", "tfuture.testing.demo_parallel", "--tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "torch.distributed.run --nproc-per-node 2 -m tfuture.testing.demo --tp 2" in proc.stderr


# --- the docs name only modules that exist -------------------------------------------------

DOCS = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "tfuture").rglob("*.py"))]


def test_no_doc_names_the_old_distributed_demo():
    stale = [str(p.relative_to(ROOT)) for p in DOCS if "tfuture.distributed.demo" in p.read_text()]
    assert not stale, f"tfuture.distributed.demo moved to tfuture.testing.demo_parallel; named in {stale}"


def test_every_documented_python_m_module_exists():
    names = {m for p in DOCS for m in re.findall(r"-m (tfuture(?:\.\w+)+)", p.read_text())}
    assert "tfuture.testing.demo" in names
    missing = sorted(m for m in names if importlib.util.find_spec(m) is None)
    assert not missing, f"documented `python -m` modules that do not exist: {missing}"


def test_test_modules_outside_packages_have_unique_basenames() -> None:
    # pytest imports a test file outside a package by its basename: two of one name collide
    # at collection and make test stops before it runs anything.
    from collections import defaultdict
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = defaultdict(list)
    for path in tests.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen[path.name].append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_no_name_on_the_tests_path_shadows_a_package_transformers_probes() -> None:
    # pytest puts tests/ on sys.path, so each folder and helper module there is importable by its
    # bare name. transformers probes optional packages with find_spec and imports what it finds:
    # a tests/kernels package once passed for the `kernels` hub package (transformers 5.25) and
    # failed every Hugging Face test at import. Names it probes must not be ours.
    import_utils = importlib.util.find_spec("transformers.utils.import_utils")
    if import_utils is None or import_utils.origin is None:
        pytest.skip("transformers is not installed")
    source = Path(import_utils.origin).read_text()
    probed = set(re.findall(r"_is_package_available\(\s*[\"']([\w.]+)[\"']", source))
    assert "torch" in probed  # the probe pattern still reads this source
    tests = Path(__file__).resolve().parent
    ours = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    ours |= {p.stem for p in tests.glob("*.py")}
    assert sorted(ours & {name.split(".")[0] for name in probed}) == []
