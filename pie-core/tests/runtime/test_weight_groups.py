"""Weights reach the engine a layer at a time, so an engine can keep each layer in one allocation."""

from __future__ import annotations

import numpy as np
from pie.runtime.model_runner import _layer_groups


def test_consecutive_weights_of_a_layer_form_one_group() -> None:
    names = ["w.embed", "w.L0.ln1", "w.L0.qkv", "w.L0.o", "w.L1.ln1", "w.L1.o", "w.L10.ln1", "w.norm", "w.lm_head"]
    groups = [[name for name, _ in group] for group in _layer_groups((n, np.zeros(1)) for n in names)]
    assert groups == [
        ["w.embed"],
        ["w.L0.ln1", "w.L0.qkv", "w.L0.o"],
        ["w.L1.ln1", "w.L1.o"],
        ["w.L10.ln1"],
        ["w.norm"],
        ["w.lm_head"],
    ]


def test_a_layer_whose_weights_arrive_apart_is_uploaded_in_pieces() -> None:
    names = ["w.L0.ln1", "w.L1.ln1", "w.L0.o"]
    groups = [[name for name, _ in group] for group in _layer_groups((n, np.zeros(1)) for n in names)]
    assert groups == [["w.L0.ln1"], ["w.L1.ln1"], ["w.L0.o"]]
