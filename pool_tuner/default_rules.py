"""The default-dispatch rules: which variant and configuration runs a problem that no record covers.

The rules are data, in ``default_rules.json`` beside this module -- the one written source of them;
``docs/design.md`` and the README print the table that ``markdown_table`` renders from it, and a
test keeps those copies true.  Each device type (``cpu``, ``gpu``) has an ordered list of rules;
the first rule whose conditions hold for the problem and whose variant is legal for it fires.  A
rule's conditions are on the problem's ``features``: equality for words, ``{"min": a, "max": b}``
(``a <= value < b``) for numbers.

A rule applies to one family of ops, which have one variant table (``variants.variants_for``):
the multi-level ops (``Operation.multi_level``: pyramids and avgmax) where it says
``"levels": "multi"``, else the single-level ops -- a rule without a ``levels`` condition is
single-level only, so the rules written before the multi-level ops, and those ``derive_rules.py``
fits to a grid of single-level problems, keep their meaning.  Its variant must be in its family's
table.  Each family's last rule of each direction has no condition but the direction (and the
family) and a variant that runs every problem (``Variant.runs_every_problem``), so every problem
gets a rule.

The CPU rules are derived from measurements: ``benchmarks/dispatch_grid.py`` tunes a broad grid of
problems and ``benchmarks/derive_rules.py`` fits a small decision tree to the results (each leaf's
variant is the one with the least geomean slowdown against each problem's best) and writes its
leaves here, with how many grid problems each leaf held and that slowdown; it keeps the
multi-level rules as they are.  The multi-level rules, and the GPU rules, are written by hand until
a grid of them exists (each rule's evidence says which).

A rule's configuration is a partial one: its parameters over the variant's default for the problem
(``Variant.default_for``).  Where that configuration is not legal for the problem the variant's own
default runs, and ``explain`` says so (``rule_config``): nothing is replaced silently.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from . import variants as variants_mod
from .problem import Problem

RULES_FILE = Path(__file__).with_name("default_rules.json")
#: The features a rule may test, and what each is (the table's legend).
FEATURES = {
    "levels": "single or multi (Operation.multi_level: pyramids and avgmax); a rule without it is single-level",
    "direction": "forward or backward",
    "kind": "avg, max or avgmax",
    "layout": "channels_first or channels_last",
    "problem_class": "global, uniform, non-uniform or upsampling; pyramid for every multi-level op (Problem.problem_class)",
    "rank": "pooled axes: 1, 2 or 3",
    "plane": "input elements per plane",
    "output_plane": "output elements per plane",
    "window": "elements of the largest window",
    "planes": "number of planes (batch x channels)",
    "output_row": "output extent of the last axis",
}
NUMERIC = ("rank", "plane", "output_plane", "window", "planes", "output_row")
#: Each family of ops (the values of ``levels``) and one of its ops: every op of a family has the
#: same variant tables (``variants._variants_of``), against which a rule's variant is checked.
FAMILY_OPS = {"single": "adaptive_avg_pool2d", "multi": "adaptive_avg_pool_pyramid2d"}


def family(when: dict) -> str:
    """The family of ops a rule with conditions ``when`` applies to: its ``levels``, else single."""
    return when.get("levels", "single")


def features(problem: Problem) -> dict:
    """The values of ``FEATURES`` for ``problem``."""
    windows = (variants_mod.max_window(i, o) for i, o in zip(problem.in_spatial, problem.out_spatial))
    return {
        "levels": "multi" if problem.operation.multi_level else "single",
        "direction": problem.direction,
        "kind": problem.operation.rules_kind,
        "layout": "channels_last" if problem.channels_last else "channels_first",
        "problem_class": problem.problem_class,
        "rank": problem.ndim,
        "plane": math.prod(problem.in_spatial),
        "output_plane": math.prod(problem.out_spatial),
        "window": math.prod(windows),
        "planes": problem.planes,
        "output_row": problem.out_spatial[-1],
    }


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    when: tuple  # sorted (feature, condition) pairs: a word, or (min, max) with either end None
    variant: str
    config: tuple  # sorted (parameter, value) pairs over the variant's default
    evidence: str  # where the rule comes from: the grid problems it held and their slowdown, or "by hand"

    @property
    def levels(self) -> str:
        """The family of ops the rule applies to (``family``); it holds for no problem of another,
        whose variant table may not have its variant."""
        return family(dict(self.when))

    def holds(self, values: dict) -> bool:
        if values["levels"] != self.levels:
            return False
        for feature, condition in self.when:
            value = values[feature]
            if isinstance(condition, tuple):
                low, high = condition
                if (low is not None and value < low) or (high is not None and value >= high):
                    return False
            elif value != condition:
                return False
        return True

    def describe_conditions(self) -> str:
        parts = []
        for feature, condition in self.when:
            if isinstance(condition, tuple):
                low, high = condition
                parts.append(" and ".join(filter(None, (low is not None and f"{feature} >= {low}",
                                                        high is not None and f"{feature} < {high}"))))
            else:
                parts.append(f"{feature} = {condition}")
        return ", ".join(parts) or "always"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the rules decided for a problem: the rule that fired, the variant, the complete
    configuration, and why the rule's own configuration was not used (None when it was)."""

    rule: Rule
    variant: variants_mod.Variant
    params: dict
    config_note: str | None


def _parse_condition(feature: str, condition, where: str):
    if feature not in FEATURES:
        raise ValueError(f"{where}: unknown feature {feature!r}; allowed: {sorted(FEATURES)}")
    if feature in NUMERIC:
        if not isinstance(condition, dict) or not set(condition) <= {"min", "max"} or not condition:
            raise ValueError(f"{where}: {feature} needs {{\"min\": a, \"max\": b}} (either end), got {condition!r}")
        return (condition.get("min"), condition.get("max"))
    if not isinstance(condition, str):
        raise ValueError(f"{where}: {feature} needs a word, got {condition!r}")
    if feature == "levels" and condition not in FAMILY_OPS:
        raise ValueError(f"{where}: levels must be one of {sorted(FAMILY_OPS)}, got {condition!r}")
    return condition


def _parse_rule(entry: dict, where: str) -> Rule:
    when = tuple(sorted((feature, _parse_condition(feature, condition, where))
                        for feature, condition in entry.get("when", {}).items()))
    directions = {c for f, c in when if f == "direction"}
    for direction in directions or {"forward", "backward"}:
        variants_mod.get_variant(FAMILY_OPS[family(dict(when))], entry["variant"], direction,
                                 argument=f"{where} variant")
    return Rule(entry["name"], when, entry["variant"], tuple(sorted(entry.get("config", {}).items())),
                entry.get("evidence", "by hand"))


def parse(data: dict, where: str = RULES_FILE.name) -> dict:
    """``{device type: ordered rules}`` of a rules document (the content of ``RULES_FILE``);
    ValueError for an unknown feature, variant (of the rule's family) or condition, or a list
    without a last rule for each family and direction."""
    parsed = {}
    for device_type_name, entry in data["devices"].items():
        table = tuple(_parse_rule(rule, f"{where} {device_type_name} rule {i}")
                      for i, rule in enumerate(entry["rules"]))
        for levels, op in FAMILY_OPS.items():
            for direction in ("forward", "backward"):
                last = [rule for rule in table
                        if rule.levels == levels and dict(rule.when).get("direction", direction) == direction][-1:]
                alone = {"direction": direction, **({} if levels == "single" else {"levels": levels})}
                if not last or dict(last[0].when) != alone or not variants_mod.get_variant(
                        op, last[0].variant, direction).runs_every_problem:
                    fallbacks = [v.name for v in variants_mod.variants_for(op, direction).values() if v.runs_every_problem]
                    raise ValueError(f"{where}: the {device_type_name} rules need a last rule for every {levels}-level "
                                     f"{direction} pass, on {alone} alone, whose variant runs every problem "
                                     f"(e.g. {fallbacks})")
        parsed[device_type_name] = table
    return parsed


@functools.lru_cache(maxsize=None)
def _shipped() -> dict:
    return parse(json.loads(RULES_FILE.read_text()))


def rules(device_type_name: str) -> tuple:
    """The ordered rules of ``device_type_name`` (``cpu`` or ``gpu``), read once from ``RULES_FILE``."""
    return _shipped()[device_type_name]


def source_of(device_type: str) -> dict:
    """What ``device_type``'s rules were derived from (``derived_from``, ``device``, ``problems``)."""
    entry = json.loads(RULES_FILE.read_text())["devices"][device_type]
    return {k: v for k, v in entry.items() if k != "rules"}


def device_type(device) -> str:
    return "cpu" if device.info.is_cpu else "gpu"


def decide(problem: Problem, device, rule_list: tuple | None = None) -> Decision:
    """The op's own variant (``Variant.operator_headers``: written for its operator alone, such as
    GeM's ``gem_plane_windows``) where one runs ``problem``, in registry order; else the first rule
    of ``rule_list`` (default: the shipped rules of ``device``'s type) that holds for ``problem``
    and whose variant is the op's and legal for it on ``device``.  The rules are derived over the
    shared variants, which know nothing of an op's own, so an op that has one tries it first."""
    values = features(problem)
    table = variants_mod.variants_for(problem.op, problem.direction)
    limits = device.info.limits
    own = [v for v in table.values() if v.operator_headers is not None and v.is_legal({}, problem, limits)]
    if own:
        rule = Rule("own variant", (), own[0].name, (), "the op's own variant, before the shared rules")
        return Decision(rule, own[0], own[0].check_config({}, problem, limits), None)
    for rule in rules(device_type(device)) if rule_list is None else rule_list:
        if not rule.holds(values):
            continue
        variant = table.get(rule.variant)  # a variant that does not fit the op (Variant.fits) is not its
        if variant is None:
            continue
        config = dict(rule.config)
        try:
            return Decision(rule, variant, variant.check_config(config, problem, limits), None)
        except ValueError as refused:
            if not variant.is_legal({}, problem, limits):
                continue  # the variant cannot run the problem at all
            params = variant.check_config({}, problem, limits)
            return Decision(rule, variant, params, f"the rule's configuration {config} is not legal here ({refused}); "
                                                   f"the variant's default runs")
    raise AssertionError(f"no default rule holds for {problem}, though parse() checks each direction's last rule")


def markdown_table(rule_list: tuple) -> str:
    """Rules (``rules(device type)``) as a Markdown table: what the docs and the README print."""
    lines = ["| # | when | variant | config | evidence |", "|---|---|---|---|---|"]
    for i, rule in enumerate(rule_list, 1):
        config = ", ".join(f"{k}={v}" for k, v in rule.config) or "default"
        lines.append(f"| {i} | {rule.describe_conditions()} | `{rule.variant}` | {config} | {rule.evidence} |")
    return "\n".join(lines)
