"""Every recipe key with its type, default, allowed values and meaning, read from qarl/config.py itself: the
meaning is the comment above a key (or beside it), the allowed values its `knob`, so the reference cannot drift
from the code. `qarl config --schema` prints it; docs/reference/configuration.md is its --markdown form.
"""

from __future__ import annotations

import ast
import inspect
import io
import tokenize
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, get_type_hints

from qarl import config as config_module
from qarl.config import RecipeConfig, allowed


@dataclass(frozen=True)
class Key:
    name: str  # dotted: policy.generation.top_p
    type: str
    default: str
    allowed: str
    meaning: str


@dataclass(frozen=True)
class Section:
    name: str  # dotted: policy.generation
    meaning: str
    keys: list[Key]


def _comments() -> tuple[dict[int, str], dict[int, str]]:
    """The comments of qarl/config.py by line number: those on lines of their own, and those beside code."""
    source = inspect.getsource(config_module)
    whole, beside = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            own_line = tok.line.strip().startswith("#")
            (whole if own_line else beside)[tok.start[0]] = tok.string.lstrip("#").strip()
    return whole, beside


def _field_lines() -> dict[tuple[str, str], int]:
    """(class name, field name) -> the line of its declaration in qarl/config.py."""
    tree = ast.parse(inspect.getsource(config_module))
    return {(node.name, item.target.id): item.lineno
            for node in tree.body if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}


def _meaning(line: int, comments: tuple[dict[int, str], dict[int, str]]) -> str:
    """The block of comment lines right above a declaration, and the comment beside it."""
    whole, beside = comments
    above, i = [], line - 1
    while i in whole:
        above.insert(0, whole[i])
        i -= 1
    return " ".join(above + ([beside[line]] if line in beside else []))


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


def _default(f: Any) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    value = f.default_factory()
    return repr(value) if not is_dataclass(value) else ""


def sections(schema: type = RecipeConfig, prefix: str = "") -> list[Section]:
    """The recipe's sections (each dataclass), depth first, with their keys."""
    comments, lines = _comments(), _field_lines()
    hints = get_type_hints(schema)
    keys, nested = [], []
    for f in fields(schema):
        hint = hints[f.name]
        if is_dataclass(hint):
            nested += sections(hint, f"{prefix}{f.name}.")
            continue
        keys.append(Key(f"{prefix}{f.name}", _type_name(hint), _default(f), allowed(f.metadata),
                        _meaning(lines[(schema.__name__, f.name)], comments)))
    doc = " ".join((inspect.getdoc(schema) or "").split())
    own = [Section(prefix.rstrip(".") or "recipe", doc, keys)] if keys else []
    return own + nested


def text() -> str:
    """The schema for a terminal."""
    out = []
    for section in sections():
        out.append(f"{section.name}: {section.meaning}")
        for k in section.keys:
            rule = f" [{k.allowed}]" if k.allowed else ""
            out.append(f"  {k.name}: {k.type} = {k.default}{rule}\n      {k.meaning}")
    return "\n".join(out)


def markdown() -> str:
    """The schema as the docs' configuration reference."""
    out = ["# Configuration reference", "",
           "Every recipe key, generated from `qarl/config.py` by `qarl config --schema --markdown` (a test fails when "
           "this page and the code differ). A recipe is YAML; `defaults: [other.yaml]` merges other recipes first; "
           "`a.b=c` on the command line overrides a key. `qarl config RECIPE` prints a recipe with every default "
           "filled in.", ""]
    for section in sections():
        out += [f"## `{section.name}`", "", section.meaning, "", "| key | type | default | allowed | meaning |",
                "|---|---|---|---|---|"]
        out += [f"| `{k.name}` | {k.type} | `{k.default}` | {k.allowed} | {k.meaning.replace('|', '/')} |"
                for k in section.keys]
        out.append("")
    return "\n".join(out)
