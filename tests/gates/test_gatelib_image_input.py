"""The image-input gate's pure verdicts on worked examples."""

import numpy as np
import pytest

from gates.lib.image_input import path_agreement, readback_verdict, same_greedy_verdict


def test_readback_needs_the_rendered_string_exactly():
    assert readback_verdict("The label reads K7-QX9.", "K7-QX9").passed
    assert readback_verdict("Slow rivers carry the night", "Slow rivers\ncarry the night").passed
    r = readback_verdict("the label reads k7-qx9", "K7-QX9")
    assert not r.passed and "case-folded" in r.why
    assert not readback_verdict("K7-QX8", "K7-QX9").passed
    with pytest.raises(ValueError):
        readback_verdict("x", "  ")


def test_same_greedy_names_the_first_difference():
    assert same_greedy_verdict([1, 2, 3], [1, 2, 3]).passed
    r = same_greedy_verdict([1, 2, 4], [1, 2, 3])
    assert not r.passed and r.first_difference == 2
    assert same_greedy_verdict([1, 2], [1, 2, 3]).first_difference == 2


def test_path_agreement():
    assert path_agreement(np.array([-1.0, -2.0]), np.array([-1.0, -2.0 + 1e-7]), 1e-5)["passed"]
    assert not path_agreement(np.array([-1.0]), np.array([-1.1]), 1e-5)["passed"]
    assert not path_agreement(np.array([np.nan]), np.array([-1.0]), 1e-5)["passed"]
