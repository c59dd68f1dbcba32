"""Two sets of tuning records for this device, raced kernel against kernel: does a re-tuning's choice
beat the record it replaces?

A record's time is what its tuning measured, under whatever load the machine had then; two
tunings' times are not comparable.  So for every problem that both files hold a record of for this
device (the same cache key: problem, device fingerprint, kernel hash), the two records' best
configurations are raced here, side by side (``tuner.race``: both launched interleaved on one queue,
timed by the device, the median of ``--repetitions`` launches each), in ``--rounds`` rounds.
Printed per problem: each side's choice, the medians over the rounds, and the median and quartiles
of the round-by-round ratio old / new (above 1: the new record's choice is faster).  Problems whose
records choose the same configuration are listed, not raced.  The load average is printed before
and after.

``--winners FILE`` writes a tuning-cache file of each problem's faster record: the new one where its
choice won every round's quartile (the round-by-round ratio's first quartile above 1) or where both
choose the same configuration, else the old one -- to keep a re-tuning only where it is faster,
``pool-tuner cache merge FILE --into OLD.json`` (the merge replaces a record by a faster-measured one,
so an old record the file holds again stays as it is).

    python benchmarks/record_race.py OLD.json NEW.json [--rounds 5] [--repetitions 20] [--winners FILE]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from pool_tuner import backends, cache, dispatch, tuner


def own_records(path: Path, device) -> dict:
    """The well-formed records of ``path`` (a tuning-cache file, read as the cache reads one) whose
    key names ``device``; what is wrong with the others is printed."""
    records, problems = cache._read(path)
    if problems:
        print(f"{path}: not raced: {'; '.join(problems)}")
    return {key: record for key, record in records.items() if key == cache.cache_key(cache.problem_of(record), device)}


def choice_of(record: dict, problem, device) -> dispatch.Choice:
    """The configuration a record runs, validated on ``device`` as a forced call would be."""
    best = record["best"]
    return dispatch.choose(problem, device, variant=best["variant"], config=best["params"], memoise=False)


def describe(choice: dispatch.Choice) -> str:
    return f"{choice.variant.name} {dict(choice.params)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a tuning-cache file (e.g. tuning_cache/pocl_cpu.json)")
    parser.add_argument("new", type=Path, help="a tuning-cache file with records of the same problems")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--winners", type=Path, help="write each problem's faster record to this cache file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repetitions < 1:
        parser.error("--rounds and --repetitions must be at least 1")
    device = backends.default_device()
    old, new = own_records(args.old, device), own_records(args.new, device)
    common = sorted(set(old) & set(new))
    print(f"device {device.info.describe()}: {len(old)} records of it in {args.old}, {len(new)} in {args.new}, "
          f"{len(common)} problems in both; load average before {os.getloadavg()}")
    rng = np.random.default_rng(0)
    ratios, winners = [], {}
    for key in common:
        problem = cache.problem_of(new[key])
        old_choice, new_choice = (choice_of(records[key], problem, device) for records in (old, new))
        label = f"{problem.op} {problem.direction} {'x'.join(map(str, problem.input_shape))} -> " \
                f"{'x'.join(map(str, problem.output_shape))} {problem.dtype} {problem.layout}"
        if (old_choice.variant.name, old_choice.params) == (new_choice.variant.name, new_choice.params):
            print(f"{label}: the same choice, {describe(new_choice)}")
            winners[key] = new[key]
            continue
        rounds = np.array([tuner.race(problem, device, [old_choice, new_choice], args.repetitions, rng)
                           for _ in range(args.rounds)])
        ratio = rounds[:, 0] / rounds[:, 1]
        ratios.append(float(np.median(ratio)))
        winners[key] = new[key] if np.percentile(ratio, 25) > 1.0 else old[key]
        print(f"{label}:\n  old {describe(old_choice)} {np.median(rounds[:, 0]):.4f} ms\n"
              f"  new {describe(new_choice)} {np.median(rounds[:, 1]):.4f} ms\n"
              f"  old / new {np.median(ratio):.2f}x (quartiles {np.percentile(ratio, 25):.2f}-"
              f"{np.percentile(ratio, 75):.2f})")
    if ratios:
        print(f"raced {len(ratios)} problems: geomean old / new {float(np.exp(np.mean(np.log(ratios)))):.2f}x, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}x")
    if args.winners:
        cache._write_atomic(args.winners, winners)
        kept_new = sum(winners[key] is new[key] for key in winners)
        print(f"wrote {args.winners}: {kept_new} new records, {len(winners) - kept_new} old")
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
