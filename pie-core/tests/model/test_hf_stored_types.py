"""Hugging Face folders in bf16/f16 keep their type, and ``dtype`` (``--dtype``) converts on request."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from pie.model import ModelLoadError, load_model, weight_shapes
from pie.testing.models import make_gguf_model, make_hf_model
from pie.weights import DTYPES, Dtype, StoredWeight, describe_dtype_conversions, to_dtype, weight_type

pytest.importorskip("transformers")

HALF = {"bfloat16": "bf16", "float16": "f16"}


@pytest.fixture(scope="module", params=sorted(HALF))
def half_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny random Llama folder in bf16 or f16, sharded (an index and several files), its head tied."""
    folder = make_hf_model(tmp_path_factory.mktemp(request.param), dtype=request.param, max_shard_size="60KB",
                           tie_word_embeddings=True)
    return folder, HALF[request.param]


def test_half_precision_matrices_come_in_their_type_as_views_of_the_files(half_folder: tuple[Path, str]) -> None:
    folder, stored_type = half_folder
    assert len(list(folder.glob("*.safetensors"))) > 2
    loaded = load_model(folder)
    dense = dict(loaded.tensors())
    shapes = weight_shapes(loaded.config)
    assert loaded.file_types == dict.fromkeys(shapes, stored_type)
    names = []
    for name, weight in loaded.stored_tensors():
        names.append(name)
        if len(shapes[name]) == 1:  # norms go as float32, as the GGUF loader gives them
            assert isinstance(weight, np.ndarray) and weight.dtype == np.float32 and weight.flags.writeable
            np.testing.assert_array_equal(weight, dense[name])
            continue
        assert isinstance(weight, StoredWeight) and weight.type == stored_type, name
        assert weight.shape == shapes[name] and not weight.data.flags.writeable  # the memory map itself
        np.testing.assert_array_equal(weight.dequantize(), dense[name], err_msg=name)
    assert names == list(shapes)


def test_the_float_tensors_stay_the_callers_to_modify(half_folder: tuple[Path, str]) -> None:
    name, array = next(load_model(half_folder[0]).tensors())
    assert array.dtype == np.float32 and array.flags.writeable and array.flags.c_contiguous
    array[0, 0] = 7.0  # a copy: the file's map is read-only
    assert next(load_model(half_folder[0]).tensors())[1][0, 0] != 7.0


def test_file_weight_bytes_are_the_safetensors_tensor_bytes(half_folder: tuple[Path, str]) -> None:
    from safetensors import safe_open

    folder, _ = half_folder
    loaded = load_model(folder)
    shapes = weight_shapes(loaded.config)
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as handle:
            total += sum(handle.get_tensor(name).nbytes for name in handle.keys() if name in shapes)  # noqa: SIM118
    assert loaded.file_weight_bytes() == total


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_converts_every_matrix_and_lists_each_conversion(tmp_path: Path, dtype: Dtype) -> None:
    folder = make_hf_model(tmp_path, dtype="bfloat16")
    target = DTYPES[dtype]
    plain, converted = load_model(folder), load_model(folder, dtype)
    dense = dict(plain.tensors())
    shapes = weight_shapes(plain.config)
    for name, weight in converted.stored_tensors():
        if len(shapes[name]) == 1:
            assert weight_type(weight) == "f32"
            continue
        assert weight_type(weight) == target, name
        got = weight if isinstance(weight, np.ndarray) else weight.dequantize()
        # bf16 values are exact in float32 and kept by bf16; f16 rounds them to nearest, as numpy casts.
        want = dense[name].astype(np.float16).astype(np.float32) if target == "f16" else dense[name]
        np.testing.assert_array_equal(got, want, err_msg=name)
    matrices = [name for name, shape in shapes.items() if len(shape) == 2]
    expected = {} if target == "bf16" else dict.fromkeys(matrices, ("bf16", target))
    assert converted.conversions() == expected
    assert plain.conversions() == {}
    text = describe_dtype_conversions(dtype, converted.conversions())
    if expected:
        assert text.startswith(f"--dtype {dtype}: {len(matrices)} matrices converted while loading")
        assert f"bf16 -> {target}: model.embed_tokens.weight" in text
    else:
        assert "nothing converted" in text


def test_dtype_float16_on_a_float32_folder_gives_float16_matrices(tiny_hf_model: Path) -> None:
    loaded = load_model(tiny_hf_model, "float16")
    dense = dict(load_model(tiny_hf_model).tensors())
    for name, weight in loaded.stored_tensors():
        if dense[name].ndim == 2:
            assert isinstance(weight, StoredWeight) and weight.type == "f16"
            np.testing.assert_array_equal(weight.data.view(np.float16), dense[name].astype(np.float16))


def test_a_block_quantized_gguf_converts_to_float32_only(tmp_path: Path) -> None:
    path = make_gguf_model(tmp_path / "q.gguf", "Q4_1")
    dense = dict(load_model(path).tensors())
    for name, weight in load_model(path, "float32").stored_tensors():
        assert isinstance(weight, np.ndarray) and weight.dtype == np.float32
        np.testing.assert_array_equal(weight, dense[name])  # the exact dequantization
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ModelLoadError, match=rf"q\.gguf: tensor 'model\.embed_tokens\.weight' cannot be loaded "
                           rf"as dtype {dtype}: it is stored as q4_1, and {DTYPES[dtype]} would round"):
            load_model(path, dtype)


def test_float_gguf_matrices_convert_like_a_folder(tmp_path: Path) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "f16.gguf", "F16"), "bfloat16")
    types = {weight_type(w) for _, w in loaded.stored_tensors() if len(w.shape) == 2}
    assert types == {"bf16"} and set(loaded.conversions().values()) == {("f16", "bf16")}


def test_an_unknown_dtype_is_refused_before_the_model_is_read(tmp_path: Path) -> None:
    assert get_args(Dtype) == tuple(DTYPES)  # the option's values are the table's
    with pytest.raises(ValueError, match=r"dtype 'int8' is not one of auto, float32, float16, bfloat16"):
        load_model(tmp_path / "nothing-here", "int8")  # type: ignore[arg-type]  # what a caller may pass


def test_a_value_beyond_float16s_range_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    folder = make_hf_model(tmp_path)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = 1e5
    save_file(tensors, file, metadata={"format": "pt"})
    stream = load_model(folder, "float16").stored_tensors()
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' cannot be loaded as "
                       r"dtype float16: it holds 100000, beyond float16's range \(±65504\); dtype bfloat16"):
        list(stream)
    assert weight_type(to_dtype(tensors["model.layers.1.mlp.down_proj.weight"], "bf16")) == "bf16"
