"""`pie run` from start to exit next to llama-cpp-python doing the same, each a fresh process.

    python benchmarks/run_startup.py [--rounds 7] [--max-tokens 16] [--threads N]
        [--llama-pythonpath DIR[:DIR]] [--llama-lib DIR]

Each round runs (a) ``pie run QUESTION --max-tokens 16 --engine cpu`` on the embedded default model
and (b) a Python process that loads the same GGUF file with llama-cpp-python, asks it the same
question as one greedy chat completion of the same length, prints the answer and exits. The two
alternate (AB, then BA). Each child's wall time (from start to exit) and peak resident memory
(``ru_maxrss`` of that child alone, from ``os.wait4``) are recorded; the script prints their medians,
pie's ratios to llama-cpp-python, whether they meet the goal (within 1.5x on both), and each one's
answer. One untimed run of each comes first (the model is in the page cache, pie's native kernels are
built). llama.cpp gets as many threads as pie's CPU engine uses (the CPUs this process may run on).

llama-cpp-python is imported in its child only: ``--llama-pythonpath`` (default: ``$LLAMA_CPP_PYTHONPATH``)
is put in front of that child's ``PYTHONPATH``, and ``--llama-lib`` (default: ``$LLAMA_CPP_LIB_PATH``)
names the folder of its shared libraries. Without it the script measures pie alone and says so.

Both children run with bytecode caching on (in a folder of the system's temporary directory,
``PYTHONPYCACHEPREFIX``) whatever this environment says: an installed wheel has its bytecode compiled,
and compiling pie's sources on every start would be measured otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

QUESTION = "What is the capital of France?"
GOAL_RATIO = 1.5
EXPECTED_WORD = "Paris"

_PIE = "import sys; from pie.cli import app; sys.argv[0] = 'pie'; app()"
_LLAMA = """
import sys
import llama_cpp
path, question, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, verbose=False)
reply = model.create_chat_completion([{"role": "user", "content": question}], max_tokens=tokens, temperature=0.0)
print(reply["choices"][0]["message"]["content"])
"""


@dataclass(frozen=True)
class ChildRun:
    seconds: float
    cpu_seconds: float
    """User and system time of all its threads: what a loaded machine inflates least."""
    peak_bytes: int
    answer: str


def run_child(command: list[str], env: dict[str, str]) -> ChildRun:
    """Run ``command`` to its exit; its wall time, its own peak RSS and what it printed on stdout."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # reaped here, with its own rusage
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        printed, errors = stdout.read(), stderr.read()
    if child.returncode != 0:
        raise RuntimeError(f"{command[:3]} exited with {child.returncode}:\n{errors.strip()[-2000:]}")
    return ChildRun(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, printed.strip())


def llama_environment(pythonpath: str | None, lib: str | None) -> dict[str, str] | None:
    """The environment of llama-cpp-python's child, or None if llama_cpp cannot be imported with it."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    if lib:
        env["LLAMA_CPP_LIB_PATH"] = lib
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"llama-cpp-python cannot be imported ({probe.stderr.strip().splitlines()[-1:]}); measuring pie alone")
        return None
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama.cpp's threads (default: as many as pie uses)")
    parser.add_argument("--llama-pythonpath", default=os.environ.get("LLAMA_CPP_PYTHONPATH"))
    parser.add_argument("--llama-lib", default=os.environ.get("LLAMA_CPP_LIB_PATH"))
    args = parser.parse_args()

    from pie.model.store import resolve_model

    model = Path(resolve_model(None))  # pulled once here if it is not in the store yet
    tokens = str(args.max_tokens)
    commands = {"pie": [sys.executable, "-c", _PIE, "run", QUESTION, "--max-tokens", tokens, "--engine", "cpu"]}
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "pie-run-startup-pycache")
    environments = {"pie": dict(os.environ)}
    llama_env = llama_environment(args.llama_pythonpath, args.llama_lib)
    if llama_env is not None:
        commands["llama-cpp-python"] = [sys.executable, "-c", _LLAMA, str(model), QUESTION, tokens, str(args.threads)]
        environments["llama-cpp-python"] = llama_env
    print(f"model {model} ({model.stat().st_size / 1e6:.1f} MB), {args.max_tokens} tokens, {args.rounds} rounds, "
          f"llama.cpp threads {args.threads}, load average {open('/proc/loadavg').read().split()[:3]}")
    for who in commands:  # untimed: page cache, native kernel build
        run_child(commands[who], environments[who])
    runs: dict[str, list[ChildRun]] = {who: [] for who in commands}
    for round_ in range(args.rounds):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
        for who in order:
            runs[who].append(run_child(commands[who], environments[who]))
            got = runs[who][-1]
            print(f"  round {round_ + 1} {who:<17} {got.seconds:6.2f} s wall {got.cpu_seconds:6.2f} s CPU "
                  f"{got.peak_bytes / 1e6:6.0f} MB")
    medians = {who: (statistics.median(r.seconds for r in got), statistics.median(r.peak_bytes for r in got))
               for who, got in runs.items()}
    print(f"medians           {'wall s':>7} {'CPU s':>6} {'peak MB':>8}  answer")
    for who, (seconds, peak) in medians.items():
        answers = sorted({r.answer for r in runs[who]})
        cpu = statistics.median(r.cpu_seconds for r in runs[who])
        print(f"{who:<17} {seconds:7.2f} {cpu:6.2f} {peak / 1e6:8.0f}  {' | '.join(map(repr, answers))}")
    pie_says_paris = all(EXPECTED_WORD in r.answer for r in runs["pie"])
    print(f"pie answers {EXPECTED_WORD!r}: {'yes' if pie_says_paris else 'NO'}")
    if "llama-cpp-python" in medians:
        (pie_s, pie_b), (llama_s, llama_b) = medians["pie"], medians["llama-cpp-python"]
        # Ratios per round (each pair ran back to back), then their median: the machine's speed drifts.
        wall = statistics.median(p.seconds / q.seconds for p, q in zip(runs["pie"], runs["llama-cpp-python"]))
        peak = statistics.median(p.peak_bytes / q.peak_bytes for p, q in zip(runs["pie"], runs["llama-cpp-python"]))
        print(f"pie / llama-cpp-python: wall {wall:.2f}x, peak memory {peak:.2f}x (median of the rounds' ratios; "
              f"ratio of medians {pie_s / llama_s:.2f}x, {pie_b / llama_b:.2f}x)")
        met = wall <= GOAL_RATIO and peak <= GOAL_RATIO and pie_says_paris
        print(f"goal (within {GOAL_RATIO}x on both, answering {EXPECTED_WORD!r}): {'met' if met else 'NOT met'}")
    print(f"load average at the end {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
