"""Pure verdict and metric logic of the engine-behaviour gates (gates.md §4–§9).

One module per gate; no IO here: the gate files under gates/ talk to the engine, these modules only
turn what the engine said into numbers and verdicts, so unit tests (tests/test_gatelib_*.py) can
drive every verdict, including every failure, from synthetic inputs.
"""
