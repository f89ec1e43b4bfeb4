"""The documentation stays true to the repository: the docs site builds with no warning (`mkdocs build --strict`:
every page in the nav, every link between pages and every anchor resolves), the README stays short and its links point
at files that exist, the repository paths the docs name exist, and the example recipes and reward load."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qarl.config import load_recipe
from tests.conftest import REPO

README = REPO / "README.md"
README_MAX_LINES = 260
# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A repository path in backticks, as the docs name files outside docs/ (mkdocs cannot check those links).
REPO_PATH = re.compile(r"`((?:benchmarks|recipes|export|quant_configs|examples|scripts|qarl|tests)/[^`\s]*)`")


def _expand_braces(pattern: str) -> list[str]:
    """`a{1,2}b` -> [a1b, a2b] (one level, as the docs write them)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [pattern[:match.start()] + part + pattern[match.end():] for part in match.group(1).split(",")]


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (the test and docs extras install them: "
                    "bash scripts/setup.sh)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about MkDocs 2.0 is not a build warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, f"mkdocs build --strict printed warnings:\n{output}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move details into docs/ and link them")


def test_readme_links_point_at_files() -> None:
    missing = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL or an anchor in the README
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (REPO / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_repository_paths_in_docs_exist() -> None:
    """Files outside docs/ are named as paths in backticks (mkdocs cannot check links to them): each must exist, or
    match something where it is a glob."""
    missing = []
    for page in sorted((REPO / "docs").rglob("*.md")) + [README, REPO / "examples" / "README.md"]:
        for named in REPO_PATH.findall(page.read_text()):
            path = named.split(":", 1)[0].rstrip(".,;")
            if not any(glob.glob(str(REPO / p)) for p in _expand_braces(path)):
                missing.append(f"{page.relative_to(REPO)}: {named}")
    assert not missing, "docs name repository paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("recipe", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "examples").rglob("*.yaml")))
def test_example_recipes_load(recipe: str) -> None:
    load_recipe(REPO / recipe)


def test_recipe_snippets_load(tmp_path: Path) -> None:
    """The recipes shown in the README and the docs (YAML blocks with `defaults:`, written for the repository root)
    load as written."""
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    snippets = [(page, block) for page in pages
                for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S) if "defaults:" in block]
    assert snippets, "no recipe snippet found in the README"
    for i, (page, block) in enumerate(snippets):
        recipe = tmp_path / f"snippet_{i}.yaml"
        recipe.write_text(re.sub(r"(?<![\w/])recipes/", f"{REPO}/recipes/", block))  # defaults are relative to the file
        try:
            load_recipe(recipe)
        except Exception as e:  # noqa: BLE001 - name the page whose snippet broke
            pytest.fail(f"the recipe snippet in {page.relative_to(REPO)} does not load: {e}")


def test_example_reward_resolves_and_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/custom_reward.py is named in a recipe as examples.custom_reward:final_number with the repository root
    on the path; it returns one float per completion."""
    from qarl.rewards import resolve_reward

    monkeypatch.syspath_prepend(str(REPO))
    fn = resolve_reward("examples.custom_reward:final_number")
    assert fn(["so the answer is #### 72", "It is 1,000.", "no number"], ["... #### 72", "1000", "5"]) == [1.0, 1.0, 0.0]
    brevity = resolve_reward("examples.custom_reward:brevity")
    scores = brevity(["x" * 10, "x" * 2000], ["", ""])
    assert scores == [1.0, 0.0]
