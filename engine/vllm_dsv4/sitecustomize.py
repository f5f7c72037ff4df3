"""Run at interpreter start in every process of a vLLM server launched with this folder on PYTHONPATH
(profile ``vllm-cpu-dsv4``): registers the fixes named in ``DS41_VLLM_FIXES`` (see ds41_vllm_fixes.py),
then hands over to any other ``sitecustomize`` further down ``sys.path``, which this one shadows."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
import ds41_vllm_fixes  # noqa: E402  (this folder is on sys.path: that is how this file was found)

ds41_vllm_fixes.install()

_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
