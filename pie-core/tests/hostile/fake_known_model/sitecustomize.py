"""Test support, not a test: a `pie` started with this folder on PYTHONPATH and PIE_TEST_KNOWN_MODEL
set (a JSON `KnownModel`) knows one more model, so the store tests can pull it with the real pip from
a local wheel (PIP_NO_INDEX, PIP_FIND_LINKS) instead of PyPI. Python imports `sitecustomize` at
start-up; see test_hostile_model_store.py."""

import json
import os

if os.environ.get("PIE_TEST_KNOWN_MODEL"):
    from pie.model import store

    _known = store.KnownModel(**json.loads(os.environ["PIE_TEST_KNOWN_MODEL"]))
    store.KNOWN_MODELS[_known.name] = _known
