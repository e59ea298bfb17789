"""The package is layered: :data:`LAYERS` lists every module of tfuture, lowest layer first,
and each import goes from a layer to the same layer or a lower one. No module imports one that
imports it back, nothing imports the test tools (``tfuture.testing``) but the test tools, and
nothing imports the top-level ``tfuture`` package.

Every import counts, including function-local ones and those under ``TYPE_CHECKING``: a
cycle hidden that way is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tfuture

ROOT = Path(tfuture.__file__).parent


def module_name(path: Path) -> str:
    parts = ["tfuture", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: tfuture modules it imports}``, from the source of every module."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from tfuture.x import y" names module tfuture.x.y when that is a module.
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                if t in modules and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_tfuture_has_no_import_cycle():
    graph = import_graph()
    assert "tfuture.core.future_map" in graph and "tfuture.core.slots" in graph["tfuture.core.future_map"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Lowest first. An entry names one module, or ``pkg.*``: the package and every module under it.
# A new module must be added here: the test says which layer it fits in.
LAYERS: list[set[str]] = [
    {"tfuture.core", "tfuture.core.errors", "tfuture.core.checks", "tfuture.core.rows"},
    {"tfuture.core.params", "tfuture.core.handles", "tfuture.core.slots"},  # params; slots, handles
    {"tfuture.kernels.*"},  # Triton kernels and their numpy twins
    {"tfuture.core.debug"},  # device slot states
    {"tfuture.core.future_map"},
    {"tfuture.core.future_fields"},
    {"tfuture.core.batch"},  # Batch, ForwardBatch, StepResult, the Model/Scheduler protocols
    {
        "tfuture.spec.batch",
        "tfuture.spec.drafter",
        "tfuture.spec.ngram_cpu",
        "tfuture.spec.ngram",
    },  # drafters
    {"tfuture.streams.*"},  # stream backends, staging rings, RunStats
    {"tfuture.sampling.*"},  # the device Sampler
    {"tfuture.spec.verify", "tfuture.spec.penalties"},  # acceptance, rejection sampling, penalties
    {"tfuture.steps", "tfuture.steps.masks", "tfuture.steps.samplers", "tfuture.steps.checks"},
    {"tfuture.steps.base"},  # the step-kind interface
    {"tfuture.steps.launch"},  # how the runtime stages and submits a step of any kind
    {"tfuture.steps.graphs"},  # a token step captured per bucket
    {"tfuture.steps.token_state"},  # a token step's records
    {"tfuture.steps.token_sample"},  # a token step's sample, store and replay
    {"tfuture.steps.token"},
    {
        "tfuture.spec.staging",
        "tfuture.spec.step_rows",
        "tfuture.spec.step_result",
        "tfuture.spec.step",
    },  # the token step with drafts: its plan, its ops
    {"tfuture.spec.multistep"},  # several decode steps per launch: the token step, chained
    {"tfuture.spec.spec_windows"},  # drafts and windows in one run: the two steps above
    {"tfuture.grammars.*"},
    {"tfuture.runtime"},
    {"tfuture.scheduler.*"},  # ContinuousBatcher, ServingScheduler, RequestSpec, GenerationParams
    {"tfuture.models.*"},
    {"tfuture.spec.model_drafter", "tfuture.spec"},  # a draft model; the speculative package
    {"tfuture.engine.*"},  # Engine, generate: the front door
    {"tfuture"},  # the public names; no module of tfuture imports it
    {"tfuture.distributed.*"},
    {"tfuture.examples.*"},
    {"tfuture.testing.*"},  # test tools: nothing below imports them
]


def entry_matches(entry: str, module: str) -> bool:
    if entry.endswith(".*"):
        return module == entry[:-2] or module.startswith(entry[:-1])
    return module == entry


def layer_of(module: str, layers: list[set[str]] = LAYERS) -> int | None:
    """The index of the layer holding ``module``: its exact entry, else its innermost ``pkg.*``."""
    best: tuple[int, int] | None = None  # (specificity, layer)
    for i, layer in enumerate(layers):
        for e in layer:
            if entry_matches(e, module):
                rank = len(e) + (1000 if not e.endswith(".*") else 0)
                if best is None or rank > best[0]:
                    best = (rank, i)
    return None if best is None else best[1]


def describe(i: int, layers: list[set[str]] = LAYERS) -> str:
    return f"LAYERS[{i}] {sorted(layers[i])}"


def fit(module: str, graph: dict[str, set[str]], layers: list[set[str]]) -> tuple[int, int, str]:
    """``(lo, hi, why)``: ``module`` fits in the layers ``lo..hi`` (none when ``lo > hi``): at or
    above everything it imports, at or below everything that imports it."""
    deps = {d: i for d in graph[module] if (i := layer_of(d, layers)) is not None}
    users = {u: i for u, ds in graph.items() if module in ds and (i := layer_of(u, layers)) is not None}
    lo = max(deps.values(), default=0)
    hi = min(users.values(), default=len(layers) - 1)
    top_dep = max(deps, key=lambda d: (deps[d], d), default=None)
    low_user = min(users, key=lambda u: (users[u], u), default=None)
    why = (
        f"it imports {top_dep} ({describe(lo, layers)})" if top_dep else "it imports no tfuture module"
    ) + (f", {low_user} ({describe(hi, layers)}) imports it" if low_user else ", nothing imports it")
    return lo, hi, why


def placement(module: str, graph: dict[str, set[str]], layers: list[set[str]] = LAYERS) -> str:
    """Where a module that is in no layer fits."""
    lo, hi, why = fit(module, graph, layers)
    if lo > hi:
        return f"{module} is in no layer, and fits in none: {why}; break one of those imports"
    fits = f"add it to {describe(lo, layers)}" + (f" (any layer up to LAYERS[{hi}] fits)" if hi > lo else "")
    return f"{module} is in no layer: {fits}; {why}"


def layer_problems(graph: dict[str, set[str]], layers: list[set[str]] = LAYERS) -> list[str]:
    """Every module in no layer (with where it fits), every stale entry, every upward import."""
    problems = [placement(m, graph, layers) for m in sorted(graph) if layer_of(m, layers) is None]
    for i, layer in enumerate(layers):
        for e in sorted(layer):
            if not any(entry_matches(e, m) for m in graph):
                problems.append(f"{describe(i, layers)} names {e!r}, which is no module any more: remove it")
    for m in sorted(graph):
        mi = layer_of(m, layers)
        for d in sorted(graph[m]):
            di = layer_of(d, layers)
            if mi is not None and di is not None and di > mi:
                lo, hi, why = fit(m, graph, layers)
                fix = (
                    f"move {m} up to {describe(lo, layers)} (an entry by its name), or drop the import"
                    if lo <= hi
                    else f"drop the import ({m} fits in no layer: {why})"
                )
                here, there = describe(mi, layers), describe(di, layers)
                problems.append(f"{m} ({here}) imports {d}, a higher layer ({there}): {fix}")
    return problems


def test_layer_check_names_the_problem():
    layers = [{"p.a"}, {"p.b.*"}, {"p.c"}]
    graph = {"p.a": set(), "p.b": set(), "p.b.x": {"p.a"}, "p.c": {"p.b.x"}}
    assert layer_problems(graph, layers) == []
    assert layer_problems({**graph, "p.a": {"p.c"}}, layers) == [
        "p.a (LAYERS[0] ['p.a']) imports p.c, a higher layer (LAYERS[2] ['p.c']): drop the import "
        "(p.a fits in no layer: it imports p.c (LAYERS[2] ['p.c']), p.b.x (LAYERS[1] ['p.b.*']) imports it)"
    ]
    assert layer_problems({**graph, "p.b.x": {"p.c"}, "p.c": set()}, layers) == [
        "p.b.x (LAYERS[1] ['p.b.*']) imports p.c, a higher layer (LAYERS[2] ['p.c']): "
        "move p.b.x up to LAYERS[2] ['p.c'] (an entry by its name), or drop the import"
    ]
    assert layer_problems({**graph, "p.new": {"p.b.x"}}, layers) == [
        "p.new is in no layer: add it to LAYERS[1] ['p.b.*'] (any layer up to LAYERS[2] fits); "
        "it imports p.b.x (LAYERS[1] ['p.b.*']), nothing imports it"
    ]
    assert layer_problems({**graph, "p.new": {"p.c"}, "p.a": {"p.new"}}, layers)[0] == (
        "p.new is in no layer, and fits in none: it imports p.c (LAYERS[2] ['p.c']), "
        "p.a (LAYERS[0] ['p.a']) imports it; break one of those imports"
    )
    assert layer_problems({k: v for k, v in graph.items() if k != "p.c"}, layers) == [
        "LAYERS[2] ['p.c'] names 'p.c', which is no module any more: remove it"
    ]
    assert layer_of("p.b.y.z", layers) == 1 and layer_of("p.bb", layers) is None


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_layers():
    problems = layer_problems(import_graph())
    assert not problems, "layering (tests/test_layers.py LAYERS):\n" + "\n".join(problems)


def test_product_does_not_import_the_test_tools():
    graph = import_graph()
    tools = "tfuture.testing"
    bad = [
        f"{m} imports {d}"
        for m, deps in sorted(graph.items())
        if not entry_matches(tools + ".*", m)
        for d in sorted(deps)
        if entry_matches(tools + ".*", d)
    ]
    assert not bad, "only tfuture.testing may import tfuture.testing: " + "; ".join(bad)
    assert "tfuture.testing.faults" not in graph["tfuture.runtime"]


def test_nothing_imports_the_top_level_package():
    users = sorted(m for m, deps in import_graph().items() if "tfuture" in deps)
    assert not users, f"these modules import the top-level tfuture package (import from its modules): {users}"


def test_the_module_defining_batch_does_not_import_sampling():
    deps = import_graph()["tfuture.core.batch"]
    assert not any(entry_matches("tfuture.sampling.*", d) for d in deps), sorted(deps)
    assert not any(entry_matches("tfuture.kernels.*", d) for d in import_graph()["tfuture.core.slots"])
