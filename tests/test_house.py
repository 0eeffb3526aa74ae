"""The house: the package's folders show the data path, and imports run one way.

Read from the source (no import): every ``import``, ``from ... import`` and
``import_module("ragsnap...")`` of every module, those inside functions included (those
under ``if TYPE_CHECKING:`` are annotations, not imports).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ragsnap"

# a package may import those of a lower rank, and its own modules (guide, section 10)
RANKS = {
    "errors": 0,
    "compression": 1,
    "prompt": 2,
    "runtime": 3,
    "citations": 3,
    "retrieval": 3,
    "cache": 4,
    "engine": 5,
    "api": 6,
    "eval": 6,
    "integrations": 6,
    "cli": 7,
    "__main__": 8,
    "ragsnap": 9,  # the top-level names (``from ragsnap import RagSnapEngine``): users only
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for child in node.body for n in ast.walk(child)}
    return inside


def _imports(module: str, annotations: bool = False) -> set[str]:
    """The ragsnap modules ``module`` imports (a name that is a submodule counts as it);
    with ``annotations``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    skip = set() if annotations else _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ragsnap"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ragsnap")}
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("ragsnap"):
                found.add(str(arg.value))
            elif isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
                prefix = str(arg.values[0].value).rstrip(".")  # f"ragsnap.cli.{name}"
                found |= {m for m in MODULES if m.startswith(prefix + ".")}
    return {m for m in found if m in MODULES and m != module}


GRAPH = {module: _imports(module) for module in MODULES}
# for cycles, an annotation's import counts too: the two modules still depend on each other
TYPED_GRAPH = {module: _imports(module, annotations=True) for module in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ragsnap"


def test_at_most_eight_modules_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 8, loose
    assert not (PACKAGE / "api").is_symlink()  # a real folder


def test_every_package_imports_only_packages_below_it():
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(module) != "ragsnap"  # the lazy top-level names of ``import ragsnap``
        and _layer(target) != _layer(module)
        and RANKS[_layer(target)] >= RANKS[_layer(module)]
    ]
    assert not upward, upward


def test_no_import_cycle():
    """Tarjan's strongly connected components: every one is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in TYPED_GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(TYPED_GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, cycles


def _reaches_into_a_runtime(source: str) -> list[int]:
    """Lines that take ``<something>.runtime`` (an engine's, whatever it is named: ``eng``,
    ``base``...) or name ``engine.runtime``; a module path (``ragsnap.runtime``) and an
    object's own runtime (``self.runtime``: it was given one) are not reaching in."""
    lines = {n for n, line in enumerate(source.splitlines(), 1) if "engine.runtime" in line}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "runtime":
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in {"self", "ragsnap"}):
                lines.add(node.lineno)
    return sorted(lines)


def test_the_engine_module_stays_small_and_nothing_outside_reaches_into_its_runtime():
    """Measurement (eval/, cli/bench/ and every other layer) is given a runtime; it never
    digs one out of an engine."""
    assert len((PACKAGE / "engine" / "engine.py").read_text().splitlines()) <= 300
    reach = defaultdict(list)
    for module, path in MODULES.items():
        if _layer(module) != "engine":
            reach[module] = _reaches_into_a_runtime(path.read_text())
    checked = {m for m in reach if m.startswith(("ragsnap.eval.", "ragsnap.cli.bench."))}
    assert {"ragsnap.eval.runner", "ragsnap.cli.bench.cache", "ragsnap.cli.bench.reuse"} <= checked
    assert not {m: lines for m, lines in reach.items() if lines}
    assert _reaches_into_a_runtime("x = eng.runtime.prefill(ids)\n") == [1]
    assert _reaches_into_a_runtime("import ragsnap.runtime\ny = self.runtime\n") == []


def test_the_checks_see_what_they_look_for():
    """The graph is read right: known imports, an f-string ``import_module``, and a
    ``TYPE_CHECKING`` import left out."""
    assert "ragsnap.engine.engine" in GRAPH["ragsnap.api.services"]
    assert "ragsnap.cli.bench.peer" in GRAPH["ragsnap.cli.bench"]
    assert "ragsnap.engine.engine" not in GRAPH["ragsnap.engine.single_answer"]


# what the cache tiers may import: their own modules, the prompt's tokens, the kept-entry data
CACHE_MAY_IMPORT = (
    "ragsnap.cache",
    "ragsnap.errors",
    "ragsnap.prompt.assembly",
    "ragsnap.prompt.documents",
    "ragsnap.compression.kept",
)


def test_the_cache_computes_nothing():
    """``ragsnap/cache`` looks up, keys, serializes and stores: it imports no module that runs
    the model (runtime, presses, the prompt's analyses), so a plan is data and the engine
    executes it (guide, section 10)."""
    imported = {
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if _layer(module) == "cache"
        for target in targets
        if not target.startswith(CACHE_MAY_IMPORT)
    }
    assert not imported, imported
    assert "ragsnap.cache.tiers.plans" in GRAPH["ragsnap.cache.tiers.cached_prefill"]


def test_the_scheduler_only_decides():
    """The scheduler reaches into no runtime of the engine (it asks the engine for a decode
    batch and the KV size of a token) and passes no callback into a prefill: it drives the
    engine's plan execution one chunk at a time."""
    source = (PACKAGE / "engine" / "scheduler.py").read_text()
    assert not [
        n
        for n, line in enumerate(source.splitlines(), 1)
        if ".runtime" in line and "ragsnap.runtime" not in line
    ]
    assert "on_chunk" not in source
    assert "ragsnap.runtime.prefill" in GRAPH["ragsnap.engine.scheduler"]  # its ChunkStep
    assert (
        not {"ragsnap.runtime.model_runtime", "ragsnap.runtime.blend", "ragsnap.runtime.tails"}
        & GRAPH["ragsnap.engine.scheduler"]
    )


# -- every setting declared once ----------------------------------------------------------

# settings whose default a module may not write as a number: the press settings read it
# from ragsnap.compression.base (DEFAULT_BUDGET...) or the configuration, the scheduler's
# from ragsnap.engine.config (DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS)
NAMED_ONCE = {"budget", "window", "kernel", "max_batch", "step_tokens"}
# the entrances, which resolve a request's options through engine.request_options only
ENTRANCES = (
    "ragsnap.api",
    "ragsnap.integrations",
    "ragsnap.cli.ask",
    "ragsnap.cli.options",
    "ragsnap.cli.serve",
    "ragsnap.engine.engine",
)


def _literal_defaults(source: str) -> list[str]:
    """``name = <number>`` defaults of :data:`NAMED_ONCE` settings: typed fields and
    parameters (``budget: int = 512``, ``def f(window=32)``), as ``line:name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            named = positional[len(positional) - len(args.defaults) :]
            pairs += zip([a.arg for a in named], args.defaults, strict=True)
            pairs += zip([a.arg for a in args.kwonlyargs], args.kw_defaults, strict=True)
        found += [
            f"{node.lineno}:{name}"
            for name, value in pairs
            if name in NAMED_ONCE
            and isinstance(value, ast.Constant)
            and type(value.value) in (int, float)
        ]
    return found


def test_every_setting_is_declared_once():
    """The press settings (press, budget, window, kernel...) are declared once, with their
    bounds, in ``engine/press_settings.py`` (part of ``EngineConfig``): no module writes the
    default budget, window or kernel, or the scheduler's, as a number; the API's
    ``compression`` fields and the CLI's press flags are made from that declaration; and the
    entrances resolve a request's press through ``engine.request_options`` alone."""
    from ragsnap.api.schemas import CompressionIn
    from ragsnap.cli import build_parser
    from ragsnap.engine.config import EngineConfig
    from ragsnap.engine.options import PRESS_FIELDS
    from ragsnap.engine.press_settings import (
        CONFIG_ONLY,
        PressSettings,
        bounds,
        setting_of,
    )

    literals = {m: _literal_defaults(p.read_text()) for m, p in MODULES.items()}
    assert not {m: found for m, found in literals.items() if found}
    assert _literal_defaults("def f(budget: int | None = 512): ...\n") == ["1:budget"]
    # the configuration holds every press setting; a request changes all but CONFIG_ONLY
    assert set(PressSettings.model_fields) <= set(EngineConfig.model_fields)
    assert set(PRESS_FIELDS) == set(PressSettings.model_fields)
    requested = {setting_of(name) for name in CompressionIn.model_fields}
    assert requested == set(PressSettings.model_fields) - CONFIG_ONLY
    for name, field in CompressionIn.model_fields.items():
        setting = PressSettings.model_fields[setting_of(name)]
        assert field.default is None and bounds(field) == bounds(setting), name
        assert field.description.startswith(setting.description) or name != setting_of(name)
    # the flags of `ask` and `serve` are the configuration's, generated from it
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("ask", "serve"):
        actions = {a.dest: a for a in commands[command]._actions}
        for name in PRESS_FIELDS:
            assert f"$RAGSNAP_{name.upper()}" in actions[name].help, (command, name)
    # one resolution of a request's options: the entrances build no press themselves
    building = {
        module: sorted(GRAPH[module] & {"ragsnap.compression.propagate"})
        + [n for n in ("make_press(", "without_propagation(") if n in path.read_text()]
        for module, path in MODULES.items()
        if module.startswith(ENTRANCES)
    }
    assert not {m: found for m, found in building.items() if found}
    assert "ragsnap.engine.request_options" in GRAPH["ragsnap.engine.engine"]
    assert "ragsnap.engine.request_options" in GRAPH["ragsnap.api.answering"]
