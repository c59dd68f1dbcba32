"""Derive the default-dispatch rules of one device type from tuned grids (``dispatch_grid.py``) of
one or several device models.

Each grid record holds every variant's raced time at its best configuration for one problem on one
model.  A variant's *slowdown* on a problem is its time over the best time measured for that
problem on that model (a variant that could not run a problem counts ``MISSING_SLOWDOWN``).  The
grids of several models (``--grid a b``) are pooled: the same problem measured on two models is
two samples, each against its own model's best, so one set of rules is fitted for all the models.
A leaf takes the variant of least *worst-case* slowdown over its samples (worst cases within
``WORST_CASE_TOLERANCE`` of the least count as equal; of those, the least summed log-slowdown):
rules that are never far from the best on any model measured are worth more on a model nobody
measured than rules that are nearest the best on average on one.  A variant's time is
its time at its best configuration for the problem (the grids keep one configuration per variant
per problem), so a leaf is judged as if its one configuration (below) were that best everywhere.

The script grows a decision tree greedily: a set of problems is scored by the least sum of the logs
of the slowdowns of one variant chosen for all of them (the splits separate problems whose fastest
variants differ; judging them by the leaves' worst cases instead grows trees whose leaves are worse
in both geomean and worst case, docs/benchmarks.md); a leaf is split on the one condition (a word
feature equal to a value, or a numeric feature below a threshold) that lowers the score most,
while each side keeps ``MIN_LEAF`` samples and the gain is at least ``MIN_GAIN``, to
``MAX_DEPTH``.  The tree is written as an ordered rule list -- a split's "yes" side first, so each
leaf needs only the conditions on its path that held -- per direction, each ending with a rule
whose variant runs every problem.  A leaf's configuration is the one its variant won with most
often among the leaf's samples, of every model.

The grid is of single-level problems, so the rules it writes are the single-level ones (no
``levels`` condition); the device type's multi-level rules (``"levels": "multi"``, written by hand)
are kept as they are, in their order, after them.  Single-level rules written by hand (their
evidence starts with ``by hand``: a variant the grid was tuned without, raced against the grid's
winners with ``grid_race.py``) are kept too, in their order, before the derived ones, and the
grid problems they decide are left out of the derivation (the derived rules never see them); but
not those whose evidence starts ``by hand, not measured`` (a device type's guesses before its first
grid, the GPU's): the grid's rules replace them.
``derived_from`` names the grid (one) or lists the grids (several) and ``device`` every model the
records were measured on.

    python benchmarks/derive_rules.py            # from the grids the shipped rules name: print, write
    python benchmarks/derive_rules.py --check    # exit 1 if the shipped rules differ from the data's
    python benchmarks/derive_rules.py --grid pocl_cpu pocl_cpu_amd_epyc_znver3   # one fit, two CPU models
    python benchmarks/derive_rules.py --data-dir DIR --device-type gpu --rules-out FILE   # a GPU session's grid

A grid cut short (a lease's budget) still gives rules: a direction with fewer than ``2 * MIN_LEAF``
problems gets one rule for them all (no split), one with none only its fallback rule, and the
script says so (``coverage``); with no finished problem at all it writes nothing and exits 1.
A grid measured with ``dispatch_grid.py --measure`` holds several configurations per variant per
problem: a variant's time is that of its fastest.

It prints, beside the rules, how well they fit each model's grid (geomean and worst slowdown
against each problem's best on that model; ``--compare FILE``: another rules file's too) and how
the nearest tuned grid problem would have done, by distance: the evidence for
``dispatch.NEAREST_MAX_DISTANCE``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

from pool_tuner import cache, default_rules, dispatch

GRID_DIR = Path(__file__).resolve().parent / "dispatch_grid"
MISSING_SLOWDOWN = 4.0
MIN_LEAF = 4
MIN_GAIN = 1.0  # in summed log-slowdown: a split must save at least e-fold on one problem, or its equal
MAX_DEPTH = 4
#: Worst-case slowdowns within this factor of each other count as equal (``least_worst_case``).
WORST_CASE_TOLERANCE = 1.1
#: How the evidence of a rule written by hand starts; and of one written by hand with nothing
#: measured behind it (replaced by the grid's rules).
BY_HAND, UNMEASURED = "by hand", "by hand, not measured"
#: The variant of each direction's last rule: legal for every problem.
FALLBACK = {"forward": "thread_per_output", "backward": "thread_per_input"}
WORD_FEATURES = ("kind", "layout", "problem_class")
NUMBER_FEATURES = ("rank", "plane", "output_plane", "window", "planes", "output_row")


class Sample:
    """One grid problem: its features, each variant's raced time and winning configuration."""

    def __init__(self, record: dict):
        self.problem = cache.problem_of(record)
        self.model = record["device"]["name"]
        self.features = default_rules.features(self.problem)
        entries = [record["best"]] + record.get("runners_up", [])
        fastest = {}  # a tuning keeps one entry per variant; a measurement (--measure) several
        for entry in entries:
            if entry.get("time_ms") and (entry["variant"] not in fastest
                                         or entry["time_ms"] < fastest[entry["variant"]]["time_ms"]):
                fastest[entry["variant"]] = entry
        self.times = {variant: e["time_ms"] for variant, e in fastest.items()}
        self.params = {variant: e["params"] for variant, e in fastest.items()}
        self.best = min(self.times.values())

    def slowdown(self, variant: str) -> float:
        return self.times[variant] / self.best if variant in self.times else MISSING_SLOWDOWN


def score(samples: list, variant: str) -> float:
    return sum(math.log(s.slowdown(variant)) for s in samples)


def worst(samples: list, variant: str) -> float:
    return max(s.slowdown(variant) for s in samples)


def variants_of(samples: list) -> list:
    return sorted({v for s in samples for v in s.times})


def least_score(samples: list) -> tuple[str, float]:
    """The variant of least summed log-slowdown over ``samples`` (ties: the name), and its score:
    how a split is judged."""
    return min(((v, score(samples, v)) for v in variants_of(samples)), key=lambda pair: (pair[1], pair[0]))


def least_worst_case(samples: list) -> str:
    """What a leaf takes: of the variants whose worst-case slowdown over ``samples`` is within
    ``WORST_CASE_TOLERANCE`` of the least, the one of least score (ties: the name).  Judged by the
    worst case alone, a leaf of many problems would take a variant slower on nearly all of them
    for a worst case a few percent lower."""
    least = min(worst(samples, v) for v in variants_of(samples))
    near = [v for v in variants_of(samples) if worst(samples, v) <= least * WORST_CASE_TOLERANCE]
    return min(near, key=lambda v: (score(samples, v), v))


def candidate_conditions(samples: list):
    """``(feature, condition)`` splits: a word equal to one of its values; a number below a
    threshold between two neighbouring values (their geometric mean, rounded: readable)."""
    for feature in WORD_FEATURES:
        values = sorted({s.features[feature] for s in samples})
        if len(values) > 1:
            yield from ((feature, value) for value in values)
    for feature in NUMBER_FEATURES:
        values = sorted({s.features[feature] for s in samples})
        for low, high in zip(values, values[1:]):
            yield feature, {"max": max(low + 1, round(math.sqrt(low * high)))}


def holds(sample: Sample, feature: str, condition) -> bool:
    value = sample.features[feature]
    return value < condition["max"] if isinstance(condition, dict) else value == condition


def grow(samples: list, depth: int) -> dict:
    """The tree over ``samples``: a leaf ``{"variant", "score", "samples"}`` or a split
    ``{"feature", "condition", "yes", "no"}``."""
    variant = least_worst_case(samples)
    leaf = {"variant": variant, "score": score(samples, variant), "samples": samples}
    leaf_score = least_score(samples)[1]
    if depth == MAX_DEPTH:
        return leaf
    best = None
    for feature, condition in candidate_conditions(samples):
        yes = [s for s in samples if holds(s, feature, condition)]
        no = [s for s in samples if not holds(s, feature, condition)]
        if len(yes) < MIN_LEAF or len(no) < MIN_LEAF:
            continue
        total = least_score(yes)[1] + least_score(no)[1]
        if best is None or total < best[0] - 1e-9:
            best = (total, feature, condition, yes, no)
    if best is None or leaf_score - best[0] < MIN_GAIN:
        return leaf
    _, feature, condition, yes, no = best
    return {"feature": feature, "condition": condition, "yes": grow(yes, depth + 1), "no": grow(no, depth + 1)}


def leaf_config(variant: str, samples: list) -> dict:
    """The configuration ``variant`` won with most often among ``samples`` (ties: the smaller)."""
    counts = collections.Counter(json.dumps(s.params[variant], sort_keys=True) for s in samples if variant in s.params)
    if not counts:
        return {}
    most = max(counts.values())
    return json.loads(min(c for c, n in counts.items() if n == most))


def flatten(tree: dict, when: dict, out: list) -> None:
    if "variant" in tree:
        samples = tree["samples"]
        slowdown = math.exp(tree["score"] / len(samples))
        models = len({s.model for s in samples})
        on = f" on {models} models" if models > 1 else ""
        out.append({"when": dict(when), "variant": tree["variant"], "config": leaf_config(tree["variant"], samples),
                    "evidence": f"{len(samples)} grid problems{on}, {slowdown:.2f}x their best, "
                                f"worst {worst(samples, tree['variant']):.2f}x"})
        return
    flatten(tree["yes"], {**when, tree["feature"]: tree["condition"]}, out)
    flatten(tree["no"], when, out)


def rule_name(device_type: str, rule: dict) -> str:
    words = [device_type]
    for feature, condition in rule["when"].items():
        words.append(f"{feature}<{condition['max']}" if isinstance(condition, dict) else str(condition))
    return "-".join(words + [rule["variant"]])


def derive(samples: list, device_type: str) -> list:
    """The ordered rules of ``device_type`` from ``samples``, per direction."""
    rules = []
    for direction in ("forward", "backward"):
        flat: list = []
        own = [s for s in samples if s.features["direction"] == direction]
        if own:  # a grid cut short by its budget may hold problems of one direction only
            flatten(grow(own, 0), {"direction": direction}, flat)
        if not flat or flat[-1]["variant"] != FALLBACK[direction]:
            flat.append({"when": {"direction": direction}, "variant": FALLBACK[direction], "config": {},
                         "evidence": "fallback: runs every problem"})
        rules.extend(flat)
    for rule in rules:
        rule["name"] = rule_name(device_type, rule)
    return [{key: rule[key] for key in ("name", "when", "variant", "config", "evidence")} for rule in rules]


def coverage(samples: list) -> list[str]:
    """What the rules of each direction can be from ``samples``: a line per direction with too few
    problems for a split (``2 * MIN_LEAF``), or none."""
    lines = []
    for direction in ("forward", "backward"):
        count = sum(s.features["direction"] == direction for s in samples)
        if count == 0:
            lines.append(f"{direction}: no grid problems: only the fallback rule ({FALLBACK[direction]})")
        elif count < 2 * MIN_LEAF:
            lines.append(f"{direction}: {count} grid problems, fewer than {2 * MIN_LEAF}: one rule for them all, "
                         f"no split")
    return lines


def geomean_slowdown(samples: list, choose) -> float:
    return math.exp(sum(math.log(s.slowdown(choose(s))) for s in samples) / len(samples))


def multi_level_rules(entry: dict) -> list:
    """The multi-level rules of a device type's ``entry`` in the rules file, in their order: kept
    rather than derived, after the single-level rules."""
    return [rule for rule in entry.get("rules", []) if default_rules.family(rule["when"]) != "single"]


def hand_rules(entry: dict) -> list:
    """The single-level rules written by hand of a device type's ``entry``, in their order: kept
    rather than derived, before the derived ones.  A rule written by hand without a measurement
    (evidence ``UNMEASURED``: a device type's first guess before any grid of it) is not kept: the
    grid's data replaces it."""
    return [rule for rule in entry.get("rules", [])
            if default_rules.family(rule["when"]) == "single" and rule.get("evidence", "").startswith(BY_HAND)
            and not rule["evidence"].startswith(UNMEASURED)]


def decided_by(rules: list, sample: Sample) -> bool:
    """Whether one of ``rules`` (as in the rules file) holds for ``sample``'s problem."""
    parsed = [default_rules._parse_rule(rule, rule["name"]) for rule in rules]
    return any(rule.holds(sample.features) for rule in parsed)


def same_kind(a, b) -> bool:
    """Whether a record of problem ``a`` could decide ``b`` as a nearest shape (``dispatch``)."""
    return (a.op, a.direction, a.layout, a.problem_class) == (b.op, b.direction, b.layout, b.problem_class)


def fit_report(samples: list, rules: list, kept: list, device, device_type: str) -> list[str]:
    """How the rules fare on each model's grid -- on the problems they were derived from, and on each
    problem left out of the derivation (rules derived from the other problems, on every model),
    which is how they fare on shapes nobody tuned -- against the winner of the same problem on
    another model, and against the nearest other grid problem's winner on the same model, by
    distance.  ``kept`` (the
    multi-level rules) completes each rule list for ``default_rules.parse``."""
    def variant_by(rule_list):
        parsed = default_rules.parse({"devices": {"derived": {"rules": rule_list + kept}}})["derived"]
        return lambda sample: default_rules.decide(sample.problem, device, parsed).variant.name

    in_sample = variant_by(rules)
    left_out = {id(s): variant_by(derive([o for o in samples if o.problem != s.problem], device_type))(s)
                for s in samples}
    lines = []
    for model in sorted({s.model for s in samples}):
        own = [s for s in samples if s.model == model]
        lines.append(f"rules on {model}: geomean {geomean_slowdown(own, in_sample):.3f}x the best over {len(own)} "
                     f"problems, worst {max(s.slowdown(in_sample(s)) for s in own):.2f}x; each left out of the "
                     f"derivation: geomean {geomean_slowdown(own, lambda s: left_out[id(s)]):.3f}x, "
                     f"worst {max(s.slowdown(left_out[id(s)]) for s in own):.2f}x")
    elsewhere = [(s, o) for s in samples for o in samples if o.model != s.model and o.problem == s.problem]
    if elsewhere:
        transfer = [s.slowdown(min(o.times, key=o.times.get)) for s, o in elsewhere]
        lines.append(f"the winner of the same problem on another model: geomean "
                     f"{math.exp(sum(map(math.log, transfer)) / len(transfer)):.3f}x the problem's best over "
                     f"{len(transfer)} problems, worst {max(transfer):.2f}x")
    buckets = collections.defaultdict(list)
    for sample in samples:
        others = [o for o in samples
                  if o is not sample and o.model == sample.model and same_kind(o.problem, sample.problem)]
        if not others:
            continue
        distance, nearest = min(((dispatch.shape_distance(sample.problem, o.problem), o) for o in others),
                                key=lambda pair: pair[0])
        winner = min(nearest.times, key=nearest.times.get)
        buckets[min(int(distance), 6)].append((sample.slowdown(winner), sample.slowdown(left_out[id(sample)])))
    lines.append("the nearest other grid problem's winner vs the rules derived without the problem, by distance "
                 "(geomean slowdowns against the problem's best):")
    for bucket in sorted(buckets):
        pairs = buckets[bucket]
        nearest_g = math.exp(sum(math.log(a) for a, _ in pairs) / len(pairs))
        rules_g = math.exp(sum(math.log(b) for _, b in pairs) / len(pairs))
        label = f"[{bucket}, {bucket + 1})" if bucket < 6 else ">= 6"
        lines.append(f"  distance {label:8s} {len(pairs):4d} problems: nearest {nearest_g:.3f}x, rules {rules_g:.3f}x")
    return lines


def shipped_grids(document: dict, device_type: str) -> list[str]:
    """The grid directories (names under ``GRID_DIR``) the shipped rules of ``device_type`` name."""
    derived_from = document["devices"].get(device_type, {}).get("derived_from") or []
    return [Path(path).parent.name for path in ([derived_from] if isinstance(derived_from, str) else derived_from)]


def rules_fit(samples: list, rule_list: list, device) -> list[str]:
    """How ``rule_list`` (a whole device type's rules, as in the rules file) fares on each model's
    samples: geomean and worst slowdown."""
    parsed = default_rules.parse({"devices": {"given": {"rules": rule_list}}})["given"]

    def choose(sample):
        return default_rules.decide(sample.problem, device, parsed).variant.name

    lines = []
    for model in sorted({s.model for s in samples}):
        own = [s for s in samples if s.model == model]
        lines.append(f"  on {model}: geomean {geomean_slowdown(own, choose):.3f}x the best over {len(own)} problems, "
                     f"worst {max(s.slowdown(choose(s)) for s in own):.2f}x")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", nargs="+", help="grid data directories under benchmarks/dispatch_grid, one per "
                                                  "device model (default: those the shipped rules name)")
    parser.add_argument("--data-dir", nargs="+", help="the grid data directories themselves, anywhere (default: from "
                                                      "--grid); the rules name each as benchmarks/dispatch_grid/<its "
                                                      "name>, where it belongs")
    parser.add_argument("--device-type", default="cpu", choices=("cpu", "gpu"), help="whose rules to write")
    parser.add_argument("--check", action="store_true", help="only compare with the shipped rules")
    parser.add_argument("--compare", metavar="RULES_JSON",
                        help="also print how this rules file's rules of the device type fare on the grids")
    parser.add_argument("--rules-out", help="write the rules file here instead of the package's")
    args = parser.parse_args(argv)
    from pool_tuner import backends

    document = json.loads(default_rules.RULES_FILE.read_text())
    grids = args.grid or shipped_grids(document, args.device_type)
    data_dirs = [Path(d) for d in args.data_dir] if args.data_dir else [GRID_DIR / grid for grid in grids]
    if not data_dirs:
        print(f"the shipped {args.device_type} rules name no grid: give --grid or --data-dir", file=sys.stderr)
        return 1
    records = [record for data_dir in data_dirs
               for record in cache.TuningCache(data_dir / "no_shipped_records", data_dir).records().values()]
    by_hand = hand_rules(document["devices"].get(args.device_type, {}))
    samples = [s for s in (Sample(r) for r in records if not cache.is_partial(r)) if not decided_by(by_hand, s)]
    if not samples:
        print(f"no finished grid problems in {', '.join(map(str, data_dirs))}", file=sys.stderr)
        return 1
    rules = by_hand + derive(samples, args.device_type)
    kept = multi_level_rules(document["devices"].get(args.device_type, {}))
    sources = [f"benchmarks/dispatch_grid/{data_dir.name}/{cache.USER_FILE}" for data_dir in data_dirs]
    entry = {"derived_from": sources[0] if len(sources) == 1 else sources,
             "device": sorted({r["device"]["name"] for r in records}),
             "problems": len(samples), "rules": rules + kept}
    if args.check:
        same = document["devices"].get(args.device_type) == entry
        print("the shipped rules are the data's" if same else "the shipped rules differ from the data's")
        return 0 if same else 1
    device = backends.default_device()
    for line in coverage(samples):
        print(line)
    for line in fit_report(samples, rules, kept, device, args.device_type):
        print(line)
    if args.compare:
        print(f"the {args.device_type} rules of {args.compare}:")
        for line in rules_fit(samples, json.loads(Path(args.compare).read_text())["devices"][args.device_type]["rules"],
                              device):
            print(line)
    document["devices"][args.device_type] = entry
    rules_file = Path(args.rules_out) if args.rules_out else default_rules.RULES_FILE
    rules_file.write_text(json.dumps(document, indent=1) + "\n")
    print(default_rules.markdown_table(default_rules.parse({"devices": {"new": entry}})["new"]))
    print(f"wrote {len(rules)} rules, and kept {len(kept)} multi-level ones, in {rules_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
