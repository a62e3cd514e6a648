"""A GGUF load drops the pages of layers already taken from the process, and what it yields stays right; a model
file changed in place while it loads is named, not a crash."""

from __future__ import annotations

import mmap
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pie.model import load_model
from pie.model.gguf_header import GGUFHeader
from pie.testing.models import make_gguf_model, random_weights, tiny_config
from pie.weights import StoredWeight

LAYERS = 6
SHAPE = {"num_layers": LAYERS, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 64}


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 model whose layers each span many pages (hidden 256, 6 layers)."""
    return make_gguf_model(tmp_path_factory.mktemp("layers") / "m.gguf", "Q8_0", **SHAPE)


def _mapped_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_DONTNEED"),
                    reason="needs Linux's /proc/self/smaps and madvise")
def test_the_pages_of_layers_taken_are_dropped_while_the_load_goes_on(layered_model: Path) -> None:
    loaded = load_model(layered_model)
    header = GGUFHeader(layered_model)
    layer_kb = sum(t.nbytes for name, t in header.tensors.items() if name.startswith("blk.0.")) // 1024
    del header
    copies, resident = [], []
    for name, weight in loaded.stored_tensors():
        data = weight.data if isinstance(weight, StoredWeight) else weight
        copies.append((name, np.array(data, copy=True)))  # what an engine does with a weight: copy it
        if name.endswith("layers.5.input_layernorm.weight"):
            resident.append(_mapped_kb(layered_model.resolve()))
    # When the last layer starts, layers 0-3 (and the embedding) have been dropped: at most two layers
    # and the tensor index are still mapped.
    assert resident and resident[0] < 3 * layer_kb, (resident, layer_kb)
    assert len(copies) > 6 * LAYERS


def test_views_read_after_their_pages_were_dropped_still_hold_the_file(layered_model: Path) -> None:
    kept = list(load_model(layered_model).stored_tensors())  # views of the map, read once the load is over
    originals = random_weights(tiny_config(**SHAPE))
    assert sorted(name for name, _ in kept) == sorted(originals)
    for name, weight in kept:
        values = weight.dequantize() if isinstance(weight, StoredWeight) else weight
        # Q8_0 keeps each weight within its block's largest magnitude / 127; zeroed pages would not.
        bound = np.abs(originals[name]).max() / 127 * 1.01
        assert np.abs(values - originals[name]).max() <= bound, name


_CHANGE_WHILE_LOADING = """
import shutil, sys
from pathlib import Path
from pie.model import ModelLoadError, load_model
model, kind = Path(sys.argv[1]), sys.argv[2]
loaded = load_model(model)
mapped = next(model.glob("*.safetensors")) if model.is_dir() else model
if kind == "truncate":  # what `cp new.gguf model.gguf` and a download restarted in place do first
    with open(mapped, "r+b") as file:
        file.truncate(3 * 4096)
elif kind == "rewrite":  # the same size, other bytes
    data = bytearray(mapped.read_bytes())
    data[-4096:] = bytes(4096)
    with open(mapped, "r+b") as file:
        file.write(data)
else:  # a new file renamed over the old one: the map keeps the old, whole
    shutil.copy(mapped, mapped.with_name("new"))
    mapped.with_name("new").replace(mapped)
try:
    print(sum(1 for _ in loaded.stored_tensors()), "read")
except ModelLoadError as exc:
    print(exc)
"""


@pytest.mark.parametrize("kind", ["truncate", "rewrite", "rename"])
@pytest.mark.parametrize("model", ["tiny_gguf_model", "tiny_hf_model"])
def test_a_file_changed_in_place_while_loading_is_named_not_a_crash(kind: str, model: str, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    # Reading a map past the file's new end killed the process with SIGBUS, no message (in a process of its own here).
    source: Path = request.getfixturevalue(model)
    copy = tmp_path / source.name
    shutil.copytree(source, copy) if source.is_dir() else shutil.copy(source, copy)
    run = subprocess.run([sys.executable, "-c", _CHANGE_WHILE_LOADING, str(copy), kind], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if kind == "rename" and model == "tiny_gguf_model":  # the map holds the file checked
        assert run.stdout.endswith(" read\n")
    else:  # a folder's files are mapped when read: a new one would not be the file checked
        mapped = next(copy.glob("*.safetensors")) if copy.is_dir() else copy
        assert run.stdout.startswith(f"{mapped}: the file changed while it was loading")
