"""The house's rules, read from the code: qarl's imports form no cycle, nothing but the CLI imports the GRPO loop, and
another library's private names live only in that library's compat module."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "qarl"
FENCES = {"qarl.generation.vllm_compat": "vLLM", "qarl.quant.modelopt_compat": "ModelOpt", "qarl.torch_compat": "torch"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The qarl modules a module imports, at any depth of its code (function-level imports count too)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_qarl_imports_form_no_cycle():
    found = modules()
    graph = {name: imported(name, path, set(found)) for name, path in found.items()}
    # a package's __init__ re-exports its modules: an import of the package is an import of what it re-exports
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own modules is how a package is built
                continue
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_nothing_but_the_cli_imports_the_grpo_loop():
    found = modules()
    importers = sorted(n for n, p in found.items() if "qarl.train" in imported(n, p, set(found)) and n != "qarl.cli")
    assert importers == [], f"{importers} import qarl.train: shared pieces belong in qarl.run (or their own module)"


def code_of(path: Path) -> str:
    """The file's source with comments and strings blanked (docstrings may name what a fence wraps)."""
    lines = path.read_text().splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            (row, col), (end_row, end_col) = token.start, token.end
            for r in range(row, end_row + 1):
                line = lines[r - 1]
                start, stop = (col if r == row else 0), (end_col if r == end_row else len(line.rstrip("\n")))
                lines[r - 1] = line[:start] + " " * (stop - start) + line[stop:]
    return "".join(lines)


def mentions(code: str, name: str) -> bool:
    """`name` in `code` as a whole identifier (or dotted path) where it begins or ends with one."""
    left = r"(?<![A-Za-z0-9_])" if re.match(r"\w", name) else ""
    right = r"(?![A-Za-z0-9_])" if re.search(r"\w$", name) else ""
    return re.search(left + re.escape(name) + right, code) is not None


@pytest.mark.parametrize("fence", sorted(FENCES))
def test_private_names_live_only_in_their_fence(fence):
    names = importlib.import_module(fence).PRIVATE_NAMES
    assert names, f"{fence} lists the private names it wraps"
    offenders = []
    for name, path in modules().items():
        if name == fence:
            continue
        code = code_of(path)
        offenders += [f"{path.relative_to(REPO)}: {n}" for n in sorted(names) if mentions(code, n)]
    assert not offenders, f"{FENCES[fence]} internals outside {fence}: {offenders}"


def imports_outside(fence: str) -> Iterator[tuple[str, ast.Import | ast.ImportFrom]]:
    """(where, import statement) for every import in qarl's modules but the fence module."""
    for name, path in modules().items():
        if name != fence:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield f"{path.relative_to(REPO)}:{node.lineno}", node


def test_vllm_is_reached_only_through_its_public_api_outside_the_fence():
    offenders = []
    for where, node in imports_outside("qarl.generation.vllm_compat"):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            if node.module != "vllm" or any(a.name not in ("LLM", "SamplingParams") for a in node.names):
                offenders.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Import) and any(a.name.startswith("vllm.") for a in node.names):
            offenders.append(f"{where} import {node.names[0].name}")
    assert not offenders, offenders


def test_modelopt_private_names_are_imported_only_in_the_fence():
    offenders = []
    for where, node in imports_outside("qarl.quant.modelopt_compat"):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "modelopt":
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                offenders.append(f"{where} {node.module} {private}")
    assert not offenders, offenders


def test_an_untested_version_is_refused_naming_both_and_the_escape_hatch(monkeypatch):
    from qarl.torch_compat import require_tested_version

    require_tested_version("lib", "1.0", True, "1.0")  # a tested version passes
    monkeypatch.delenv("QARL_ALLOW_UNTESTED_VERSIONS", raising=False)
    with pytest.raises(ImportError, match=r"lib, checked against 1\.0; 2\.0 is installed.*QARL_ALLOW_UNTESTED_VERSIONS=1"):
        require_tested_version("lib", "2.0", False, "1.0")
    monkeypatch.setenv("QARL_ALLOW_UNTESTED_VERSIONS", "1")
    with pytest.warns(RuntimeWarning, match="Running anyway"):
        require_tested_version("lib", "2.0", False, "1.0")


def test_vllm_is_checked_at_first_use(monkeypatch):
    import vllm

    from qarl.generation import vllm_compat

    monkeypatch.setattr(vllm_compat, "_checked_version", None)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("QARL_ALLOW_UNTESTED_VERSIONS", raising=False)
    with pytest.raises(ImportError, match=r"vLLM.*0\.99\.0 is installed"):
        vllm_compat.in_process_worker(object())
    monkeypatch.setattr(vllm, "__version__", next(iter(vllm_compat.TESTED_VERSIONS)) + "+cpu")
    assert vllm_compat.check_version().startswith(next(iter(vllm_compat.TESTED_VERSIONS)))
