"""Eval prompts are the engine's chat encoding of one user turn, sent as ids: the DeepSeek-V4.1 encoder
for DeepSeek models (checked against the encoder's literal layout), and raw text as the can-fail defect."""

from __future__ import annotations

from evals.code import CODE_INSTRUCTION, solution_code
from evals.data import CodeProblem
from evals.run import prompt_ids, reply_text
from panels import load_tokenizer
from panels.chat import DS_ASSISTANT, DS_BOS, DS_END_THINK, DS_USER


def test_deepseek_prompts_use_the_v41_chat_encoding():
    tok = load_tokenizer("deepseek")
    ids = prompt_ids(tok, "Write a haiku.", "model")
    literal = DS_BOS + DS_USER + "Write a haiku." + DS_ASSISTANT + DS_END_THINK
    assert ids == tok.tokenizer.encode(literal, add_special_tokens=False).ids
    assert tok.tokenizer.token_to_id(DS_ASSISTANT) in ids       # one special token, not split
    raw = prompt_ids(tok, "Write a haiku.", "raw")
    assert tok.tokenizer.token_to_id(DS_ASSISTANT) not in raw
    assert reply_text(tok, tok.tokenizer.encode("Autumn moon", add_special_tokens=False).ids) == "Autumn moon"


def test_code_prompt_and_solution_extraction():
    p = CodeProblem("T/0", "def f(x):\n    \"\"\"Double x.\"\"\"\n", "f", "    return 2 * x\n")
    assert "```python\ndef f(x):" in CODE_INSTRUCTION.format(prompt=p.prompt.strip())
    fenced = "Here:\n```python\nimport math\n\ndef f(x):\n    return 2 * x\n```\nDone."
    assert solution_code(p, fenced) == "import math\n\ndef f(x):\n    return 2 * x\n"
    # a bare body continues the prompt; an unterminated block (truncated reply) is still read
    assert solution_code(p, "    return 2 * x\n") == p.prompt + "    return 2 * x\n"
    assert solution_code(p, "```python\ndef f(x):\n    return 2") == "def f(x):\n    return 2"
