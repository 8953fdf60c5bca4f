"""Run the chaos scenarios and print a report.

    .venv/bin/python -m tests.chaos.runner                    # every scenario, 20 trials each
    .venv/bin/python -m tests.chaos.runner --trials 3 --scenarios sigstop,kill9-allreduce

Each trial starts a fresh swarm of real node processes on loopback; see harness.py for the
faults and the checks. Exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos.harness import SCENARIOS, Trial


def run(names: list[str], trials: int, keep: Path) -> list[tuple[str, list[Trial]]]:
    results = []
    for name in names:
        done = []
        for i in range(trials):
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    trial = SCENARIOS[name](Path(tmp))
                except AssertionError as e:
                    trial = Trial(name, notes=[str(e).splitlines()[0][:200]])
                if not trial.passed:  # every node's log, for the post-mortem
                    kept = keep / f"{name}-{i + 1}"
                    kept.mkdir(parents=True, exist_ok=True)
                    for log in Path(tmp).glob("*.log"):
                        shutil.copy(log, kept)
                    trial.notes.append(f"logs in {kept}")
            done.append(trial)
            print(
                f"  {name} #{i + 1}: {'pass' if trial.passed else 'FAIL'} ({time.monotonic() - started:.0f}s) "
                f"fired: {trial.fired or '-'} {'; '.join(trial.notes)}",
                flush=True,
            )
        results.append((name, done))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}")
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dtnode-chaos",
        help="where the node logs of failed trials are copied",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: nodes killed, namespaces deleted
    results = run(args.scenarios.split(","), args.trials, args.keep_logs)
    print(f"\n{'scenario':<42} {'trials':>6} {'passed':>6} {'worst round':>11}  notes")
    failed = False
    for _, trials in results:
        passed = sum(t.passed for t in trials)
        failed |= passed < len(trials)
        notes = sorted({n for t in trials for n in t.notes if not n.startswith("logs in")})
        print(
            f"{trials[0].scenario:<42} {len(trials):>6} {passed:>6} {max(t.worst_round_s for t in trials):>10.0f}s  "
            f"{'; '.join(notes)[:120] or '-'}"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
