"""Time to parse and check a device profile, as every `pie run` does for each profile it finds.

    python benchmarks/profile_parse.py

Prints, per profile the CPU engine ships, its size and the median milliseconds of parse_profile
over several timeit runs (what tests/profiles/test_loader.py once held to 10 ms with a timing assert).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from pie.profiles import parse_profile
from pie.profiles.shipped import shipped_profiles

REPEATS, NUMBER = 9, 50


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # no options: --help, or an error
    for index, text in enumerate(shipped_profiles("pie_engine_cpu")):
        runs = timeit.repeat(lambda text=text: parse_profile(text), number=NUMBER, repeat=REPEATS)
        print(f"shipped profile {index + 1}: {len(text):7d} bytes  {statistics.median(runs) / NUMBER * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
