"""Peak-memory bounds for `run_pie`, which measures what Linux reports for the child.

Linux keeps a process's peak RSS across `execve`, and the child `run_pie` forks starts as a copy of
this test process: the peak it reports is at least this process's own size at the fork (hundreds of
MB once a test has imported torch). A bound is therefore what `pie` may grow past that.
"""

from __future__ import annotations

import resource


def max_rss_mb(growth_mb: float) -> float:
    """The bound to give `assert_user_error(..., max_rss_mb=...)` for `pie` growing at most `growth_mb`."""
    return growth_mb + resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
