"""`pie serve`: the shared runtime behind an OpenAI-compatible HTTP API.

One process, one model on one engine. Two threads share the work:

- the HTTP side (uvicorn's event loop, :mod:`pie.serve.app`) parses and checks
  requests, tokenizes, admits them, writes the SSE streams and the metrics; it
  never waits on a kernel;
- the engine side (:mod:`pie.serve.engine`, a thread with an event loop of its
  own) runs the batch scheduler's steps and each request's generation: sampling,
  detokenizing, stop strings. The kernels release the GIL, so the HTTP side runs
  while a step computes.

Requests enter the engine through ``call_soon_threadsafe``; what a step produced
for every request goes back to the HTTP side in one hand-off per step.

Installed with the ``serve`` extra: ``pip install 'pie-core[serve]'``.
"""

from __future__ import annotations

SERVE_EXTRA_HINT = "pie serve needs the serve extra: pip install 'pie-core[serve]'"
RAY_EXTRA_HINT = "pie serve --ray needs the ray extra: pip install 'pie-core[ray]'"
