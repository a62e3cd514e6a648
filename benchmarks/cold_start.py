"""Cold-start time of `pie engines`, each a fresh process, median of runs.

    python benchmarks/cold_start.py [--runs 7]

Measures with remembered device probes (the default of `pie engines`) and with
`--refresh` (every installed engine imports its backend and probes its devices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time


def median_seconds(command: list[str], runs: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    pie = shutil.which("pie")
    if pie is None:
        raise SystemExit("`pie` is not on PATH: install pie-core first")
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PIE_PROBE_CACHE": os.path.join(folder, "probes.json")}
        listed = subprocess.run(
            [pie, "engines", "--json", "--refresh"], check=True, capture_output=True, text=True, env=env
        )
        names = [engine["name"] for engine in json.loads(listed.stdout)["engines"]]
        refreshed = median_seconds([pie, "engines", "--refresh"], args.runs, env)
        cached = median_seconds([pie, "engines"], args.runs, env)
        python = median_seconds(["python3", "-c", "pass"], args.runs, env)
    print(f"engines installed: {', '.join(names)}")
    print(f"python -c pass          {python * 1000:7.0f} ms (interpreter start, for scale)")
    print(f"pie engines             {cached * 1000:7.0f} ms (remembered probes; goal <= 300 ms)")
    print(f"pie engines --refresh   {refreshed * 1000:7.0f} ms (every backend imported and probed)")


if __name__ == "__main__":
    main()
