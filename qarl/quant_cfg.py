"""The quant configs a recipe names (`policy.quant_cfg`, `policy.generation.quant_cfg`, `parity.formats`,
`matrix.formats`), found and checked before ModelOpt is imported.

Importing ModelOpt takes 5-30 s (it imports torch), so every command first checks what it can without it, in well
under a second: a YAML file that is missing, not YAML, or holds a key ModelOpt's schema does not have (a misspelt
`num_bits`, `quant_cfg` entries without `quantizer_name`), and a name that is no ModelOpt built-in. The names and keys
are read from the source of ModelOpt's public `modelopt.torch.quantization.config` module, parsed (not run), so they
follow the installed ModelOpt. The values (`num_bits: e9m9`, a block size) are ModelOpt's schema to judge:
`qarl.quant.formats` validates each file with it as a run resolves its formats, before any model loads. A file that
uses ModelOpt's `imports` (several YAML documents) is left to ModelOpt whole; ModelOpt's older form of `quant_cfg` (a
mapping of patterns) is refused, since ModelOpt reorders it as it converts it.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path

import yaml

from qarl.config import REPO_ROOT, ConfigError, RecipeConfig, yaml_error

NO_QUANT = {"", "none", "null", "bf16", "fp32", "false"}  # quant_cfg spellings of "unquantized"
SHIPPED_DIR = REPO_ROOT / "quant_configs"


def find_quant_yaml(spec: str) -> Path | None:
    """A quant config's YAML file: the path as given, or relative to the repository or to quant_configs/."""
    for candidate in (Path(spec), REPO_ROOT / spec, SHIPPED_DIR / spec):
        for path in (candidate, candidate.with_suffix(".yaml")):
            if path.is_file():
                return path
    return None


def shipped_names() -> list[str]:
    """The quant configs in quant_configs/, by name (nvfp4_a16, ...)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def unknown_quant_config(spec: str, builtins: list[str], key: str = "") -> ConfigError:
    """The error for a name that is neither a quant config file nor one of ModelOpt's `builtins` (`key`: the recipe
    key that set it)."""
    near = _nearest(spec, [*shipped_names(), *builtins])
    hint = f"; did you mean {near}?" if near else "."
    where = f"{key}: " if key else ""
    return ConfigError(f"{where}unknown quant config {spec!r}: neither a YAML file nor a ModelOpt built-in{hint} Use a "
                       f"shipped config {shipped_names()} (name or path), your own YAML path, or one of ModelOpt's: "
                       f"{', '.join(builtins)}")


def _nearest(spec: str, names: list[str]) -> str | None:
    """The name `spec` most likely meant: the same words in another order or case (W4A16_NVFP4_CFG for
    NVFP4_W4A16_CFG), else the closest spelling."""
    words = sorted(spec.upper().split("_"))
    same = [name for name in names if sorted(name.upper().split("_")) == words]
    return same[0] if same else next(iter(difflib.get_close_matches(spec, names, n=1, cutoff=0.6)), None)


@functools.cache
def _modelopt_config_source() -> ast.Module | None:
    """ModelOpt's `modelopt/torch/quantization/config.py`, parsed; None where ModelOpt or that module is not there
    (then only ModelOpt itself, later, judges names and keys). `find_spec` of the top-level package finds it without
    importing it."""
    spec = importlib.util.find_spec("modelopt")
    if spec is None or spec.origin is None:
        return None
    source = Path(spec.origin).parent / "torch" / "quantization" / "config.py"
    try:
        return ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None


def builtin_config_names() -> list[str] | None:
    """The `*_CFG` configs ModelOpt defines (`mtq.NVFP4_DEFAULT_CFG`, ...), read without importing ModelOpt."""
    module = _modelopt_config_source()
    if module is None:
        return None
    names = set()
    for node in module.body:
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                   else [])
        names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.endswith("_CFG"))
    return sorted(names)


def schema_fields(class_name: str) -> list[str] | None:
    """The fields of one of ModelOpt's config classes (QuantizeConfig, QuantizerCfgEntry, QuantizerAttributeConfig),
    read without importing ModelOpt: its annotated class attributes."""
    module = _modelopt_config_source()
    found = next((n for n in (module.body if module else []) if isinstance(n, ast.ClassDef) and n.name == class_name),
                 None)
    if found is None:
        return None
    return sorted(n.target.id for n in found.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                  and not n.target.id.startswith("_") and n.target.id != "model_config")


def _check_keys(path: Path, node: yaml.MappingNode, where: str, schema: str) -> None:
    """Every key of a YAML mapping is a field of ModelOpt's `schema` class (not checked where it cannot be read)."""
    allowed = schema_fields(schema)
    if allowed is None:
        return
    for key, _ in node.value:
        if key.value not in allowed:
            near = difflib.get_close_matches(str(key.value), allowed, n=1)
            hint = f"did you mean {near[0]}?" if near else f"ModelOpt's {schema} takes {', '.join(allowed)}"
            raise ConfigError(f"{path}:{key.start_mark.line + 1}: {where}: no such key {key.value!r}; {hint}")


def _value(node: yaml.MappingNode, key: str) -> yaml.Node | None:
    return next((v for k, v in node.value if k.value == key), None)


def _check_entry(path: Path, entry: yaml.Node, where: str) -> None:
    """One `quant_cfg` entry: a mapping with `quantizer_name`, its keys and its `cfg`'s keys ModelOpt's."""
    line = entry.start_mark.line + 1
    if not isinstance(entry, yaml.MappingNode) or _value(entry, "quantizer_name") is None:
        raise ConfigError(f"{path}:{line}: {where}: each quant_cfg entry is a mapping with a quantizer_name (a "
                          "pattern such as '*weight_quantizer') and cfg and/or enable; see "
                          "quant_configs/nvfp4_a16.yaml")
    _check_keys(path, entry, where, "QuantizerCfgEntry")
    cfg = _value(entry, "cfg")
    for i, attributes in enumerate(cfg.value if isinstance(cfg, yaml.SequenceNode) else [cfg] if cfg else []):
        if isinstance(attributes, yaml.MappingNode):
            _check_keys(path, attributes, f"{where}.cfg" + (f"[{i}]" if isinstance(cfg, yaml.SequenceNode) else ""),
                        "QuantizerAttributeConfig")


def check_quant_yaml(path: Path) -> None:
    """A quant config file's YAML and keys against ModelOpt's schema, without importing ModelOpt."""
    try:
        documents = list(yaml.compose_all(path.read_text()))
    except yaml.YAMLError as e:
        raise yaml_error(path, e) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: byte {e.object[e.start]:#x} at offset {e.start} is not UTF-8; a quant config is "
                          "a YAML text file (save it as UTF-8)") from None
    if len(documents) != 1:  # ModelOpt's `imports` (a second document): ModelOpt resolves and judges it
        return
    root = documents[0]
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: a quant config is a mapping with quant_cfg (and algorithm); see "
                          "quant_configs/nvfp4_a16.yaml")
    if _value(root, "imports") is not None:
        return
    _check_keys(path, root, "top level", "QuantizeConfig")
    entries = _value(root, "quant_cfg")
    if isinstance(entries, yaml.MappingNode):
        raise ConfigError(f"{path}:{entries.start_mark.line + 1}: quant_cfg is a mapping of patterns, ModelOpt's "
                          "older form, which it reorders as it converts it (a 'default' entry then disables what it "
                          "should precede): write quant_cfg as a list of entries (quantizer_name with cfg and/or "
                          "enable) applied in order, as quant_configs/nvfp4_a16.yaml does")
    for i, entry in enumerate(entries.value if isinstance(entries, yaml.SequenceNode) else []):
        _check_entry(path, entry, f"quant_cfg[{i}]")


def check_quant_spec(spec: str | None, key: str) -> None:
    """One recipe quant config (`key` names where it is set): "none", a YAML file whose YAML and keys are ModelOpt's,
    or a ModelOpt built-in name."""
    if spec is None or str(spec).strip().lower() in NO_QUANT:
        return
    spec = str(spec).strip()
    path = find_quant_yaml(spec)
    if path is not None:
        check_quant_yaml(path)
    elif spec.endswith((".yaml", ".yml")):
        raise ConfigError(f"{key}={spec}: no such file (looked in the working directory, the repository and "
                          f"quant_configs/, which ships {', '.join(p + '.yaml' for p in shipped_names())})")
    else:
        builtins = builtin_config_names()
        if builtins is not None and spec not in builtins:
            raise unknown_quant_config(spec, builtins, key)


def check_quant_files(cfg: RecipeConfig) -> None:
    """Every quant config a recipe names, checked before ModelOpt is imported."""
    specs = [("policy.quant_cfg", cfg.policy.quant_cfg),
             ("policy.generation.quant_cfg", cfg.policy.generation.quant_cfg),
             *((f"parity.formats[{i}]", s) for i, s in enumerate(cfg.parity.formats)),
             *((f"matrix.formats[{i}]", s) for i, s in enumerate(cfg.matrix.formats))]
    for key, spec in specs:
        check_quant_spec(spec, key)
