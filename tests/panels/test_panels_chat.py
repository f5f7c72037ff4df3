"""Chat formats: the HF jinja renderer against transformers, and the DeepSeek-V4.1 encoder against
public examples (vllm-project/vllm tests/tokenizers_/test_deepseek_v41.py and its fixtures)."""

from __future__ import annotations

import pytest

from panels.chat import ChatFormatError, DeepSeekV41Format, HFJinjaFormat, chat_spans
from panels.model import Message, PanelItem, ToolCall, ToolSpec
from panels.store import load_panel
from panels.tokenizers import load_tokenizer, smollm2_tokenizer_dir

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def U(t: str) -> Message:
    return Message("user", t)


def A(t: str, reasoning: str | None = None, calls: tuple[ToolCall, ...] = ()) -> Message:
    return Message("assistant", t, tool_calls=calls, reasoning=reasoning)


def S(t: str) -> Message:
    return Message("system", t)


# ---------------------------------------------------------------------------------------------
# Hugging Face jinja (SmolLM2)


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


@pytest.mark.parametrize(
    "msgs",
    [
        [U("Hello there")],
        [U("Hello"), A("Hi! How can I help?")],
        [S("Be terse."), U("2+2?"), A("4"), U("and 3+3?")],
    ],
)
@pytest.mark.parametrize("gen", [False, True])
def test_jinja_render_matches_transformers(hf_smol, msgs, gen):
    fmt = load_tokenizer("smollm2").chat_format
    ours = fmt.render(msgs, (), add_generation_prompt=gen)
    theirs = hf_smol.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in msgs], tokenize=False, add_generation_prompt=gen
    )
    assert ours == theirs


def test_jinja_panel_ids_match_transformers_tokenization(hf_smol):
    """The ids we send are what transformers' own template + tokenizer would produce."""
    panel = load_panel("default@1")
    tok = load_tokenizer("smollm2")
    from panels.encode import encode_item

    for item in panel.items:
        if item.kind != "chat" or item.tools:
            continue
        seq = encode_item(item, tok)
        ids = hf_smol.apply_chat_template([m.to_json() for m in item.messages], tokenize=True, return_dict=False)
        assert list(seq.token_ids) == list(ids), item.id


def test_template_without_tool_support_renders_tools_inline():
    fmt = HFJinjaFormat(template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert fmt.tool_style == "inline-tool_call-json"
    spec = ToolSpec("lookup", "Look something up", {"type": "object", "properties": {"q": {"type": "string"}}})
    call = ToolCall("c1", "lookup", {"q": "otters"})
    text = fmt.render([U("find otters"), A("", calls=(call,))], (spec,), add_generation_prompt=False)
    assert text.startswith("[system]# Tools")
    assert '"name": "lookup"' in text
    assert text.endswith('[assistant]<tool_call>\n{"name": "lookup", "arguments": {"q": "otters"}}\n</tool_call>')
    # Inline tool rendering is part of the format identity, hence of the tokenizer hash.
    native = HFJinjaFormat(template="{% for m in messages %}{{ m.content }}{{ m.tool_calls }}{% endfor %}")
    assert b"inline" in fmt.identity() and b"inline" not in native.identity()


def test_template_errors_are_clear():
    with pytest.raises(ChatFormatError, match="line 1"):
        HFJinjaFormat(template="{% for m in messages %}")
    fmt = HFJinjaFormat(template="{{ raise_exception('only user/assistant') }}")
    with pytest.raises(ChatFormatError, match="only user/assistant"):
        fmt.render([U("x")], (), add_generation_prompt=False)


def test_prefix_instability_is_detected():
    # A template that writes the number of messages first cannot be split into prompt and reply.
    fmt = HFJinjaFormat(template="{{ messages|length }}{% for m in messages %}|{{ m.content }}{% endfor %}")
    item = PanelItem(id="x", domain="chat", kind="chat", score="assistant", messages=(U("q"), A("a")))
    with pytest.raises(ChatFormatError, match="not prefix-stable"):
        chat_spans(fmt, item)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1


def test_ds_chat_mode_single_turn():
    fmt = DeepSeekV41Format()
    assert fmt.render([U("question")], (), add_generation_prompt=True) == f"{BOS}<｜User｜>question<｜Assistant｜></think>"


@pytest.mark.parametrize("effort, budget", [("low", 25), ("high", 50), ("xhigh", 75), ("max", 100), (1, 1), (42, 42)])
def test_ds_numeric_reasoning_effort(effort, budget):
    fmt = DeepSeekV41Format(thinking=True, reasoning_effort=effort)
    assert fmt.render([U("question")], (), add_generation_prompt=True) == (
        f"{BOS}<｜System｜>Reasoning Effort: {budget} (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\n<｜User｜>question<｜Assistant｜><think>"
    )


@pytest.mark.parametrize("effort", ["medium", 0, 101, True, 1.5, None])
def test_ds_invalid_effort(effort):
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        DeepSeekV41Format(thinking=True, reasoning_effort=effort)


def test_ds_mid_system_gets_its_own_marker():
    fmt = DeepSeekV41Format()
    out = fmt.render([U("question"), S("answer briefly")], (), add_generation_prompt=True)
    assert out == f"{BOS}<｜User｜>question<｜System｜>answer briefly<｜Assistant｜></think>"


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("final", ["user", "assistant"])
def test_ds_generation_prompt_only_controls_final_turn(thinking, final):
    fmt = DeepSeekV41Format(thinking=thinking, reasoning_effort=50 if thinking else None)
    msgs = [U("first question"), A("first answer"), U("second question"), Message(final, "final message")]
    closed = fmt.render(msgs, (), add_generation_prompt=False)
    opened = fmt.render(msgs, (), add_generation_prompt=True)
    assert opened == closed + "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
    assert f"first answer{EOS}" in closed
    assert "<｜User｜>first question<｜Assistant｜>" in closed


def test_ds_public_fixture_multi_turn_thinking():
    """vllm tests/tokenizers_/fixtures/deepseek_v41/test_output_2.txt (input: deepseek_v4/test_input_2.json)."""
    msgs = [
        S("You are a helpful assistant."),
        U("Hello"),
        A("Hi there! How can I help you?", reasoning="The user said hello, I should greet back."),
        U("What is the capital of France?"),
        A("The capital of France is Paris.", reasoning="The user asks about the capital of France. It is Paris."),
    ]
    expected = (
        f"{BOS}<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?"
        f"{EOS}<｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the capital of "
        f"France. It is Paris.</think>The capital of France is Paris.{EOS}"
    )
    fmt = DeepSeekV41Format(thinking=True, reasoning_effort=75)
    assert fmt.render(msgs, (), add_generation_prompt=False) == expected
    assert fmt.render(msgs, (), add_generation_prompt=True) == expected + "<｜Assistant｜><think>"


def test_ds_public_fixture_tools():
    """vllm tests/tokenizers_/fixtures/deepseek_v41/test_output_1.txt (input: deepseek_v4/test_input_1.json)."""
    tools = (
        ToolSpec(
            "get_weather",
            "Get the weather for a specific location",
            {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                },
                "required": ["location"],
            },
        ),
        ToolSpec(
            "search",
            "Search the web for information",
            {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query"},
                    "num_results": {"type": "integer", "description": "Number of results to return"},
                },
                "required": ["query"],
            },
        ),
    )
    msgs = [
        S("You are a helpful assistant."),
        U("What's the weather in Beijing?"),
        A(
            "",
            reasoning="The user wants to know the weather in Beijing. I should use the get_weather tool.",
            calls=(ToolCall("call_001", "get_weather", {"location": "Beijing", "unit": "celsius"}),),
        ),
        Message("tool", '{"temperature": 22, "condition": "sunny", "humidity": 45}', tool_call_id="call_001"),
        A(
            "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.",
            reasoning="Got the weather data. Let me format a nice response.",
        ),
    ]
    D = "｜DSML｜"
    expected = (
        f"{BOS}<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        "You are a helpful assistant.\n\n## Tools\n\nYou have access to a set of tools to help answer the user's "
        f'question. You can invoke tools by writing a "<{D} calls>" block like the following:\n\n'
        f'<{D} calls>\n<{D} invoke name="$TOOL_NAME">\n<{D} parameter name="$PARAMETER_NAME" string="true|false">'
        f"$PARAMETER_VALUE</{D} parameter>\n...\n</{D} invoke>\n<{D} invoke name=\"$TOOL_NAME2\">\n...\n</{D} invoke>\n"
        f"</{D} calls>\n\nString parameters should be specified as is and set `string=\"true\"`. For all other types "
        "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> "
        "with tool calls or final response.\n\n### Available Tool Schemas\n\n"
        '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": '
        '"object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": '
        '"string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
        '{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", '
        '"properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": '
        '"integer", "description": "Number of results to return"}}, "required": ["query"]}}\n\n'
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. "
        f"I should use the get_weather tool.</think>\n\n<{D} calls>\n<{D} invoke name=\"get_weather\">\n"
        f'<{D} parameter name="location" string="true">Beijing</{D} parameter>\n'
        f'<{D} parameter name="unit" string="true">celsius</{D} parameter>\n</{D} invoke>\n</{D} calls>{EOS}'
        '<｜User｜><tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result>'
        "<｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in Beijing "
        f"is currently sunny with a temperature of 22°C and 45% humidity.{EOS}"
    )
    fmt = DeepSeekV41Format(thinking=True, reasoning_effort=75)
    assert fmt.render(msgs, tools, add_generation_prompt=False) == expected


def test_ds_tool_results_follow_call_order_and_non_strings_are_json():
    fmt = DeepSeekV41Format()
    calls = (ToolCall("a", "f", {"n": 3, "flags": [True]}), ToolCall("b", "f", {"s": "x"}))
    spec = ToolSpec("f", "f", {"type": "object"})
    msgs = [
        U("go"),
        A("", calls=calls),
        Message("tool", "RB", tool_call_id="b"),
        Message("tool", "RA", tool_call_id="a"),
        U("thanks"),
        A("ok"),
    ]
    out = fmt.render(msgs, (spec,), add_generation_prompt=False)
    assert "<tool_result>RA</tool_result>\n\n<tool_result>RB</tool_result>\n\nthanks<｜Assistant｜></think>ok" in out
    assert '<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>' in out
    assert '<｜DSML｜ parameter name="flags" string="false">[true]</｜DSML｜ parameter>' in out
    assert '<｜DSML｜ parameter name="s" string="true">x</｜DSML｜ parameter>' in out


def test_ds_spans_cover_reply_and_eos_only():
    fmt = DeepSeekV41Format()
    item = PanelItem(id="x", domain="chat", kind="chat", score="assistant", messages=(U("q1"), A("a1"), U("q2"), A("a2")))
    r = chat_spans(fmt, item)
    assert [r.text[a:b] for a, b in r.spans] == [f"a1{EOS}", f"a2{EOS}"]


def test_ds_thinking_multi_turn_is_not_prefix_stable():
    # Dropped reasoning of earlier turns changes earlier text, so replies cannot be located; the
    # panel therefore encodes DeepSeek chats with thinking off.
    fmt = DeepSeekV41Format(thinking=True, reasoning_effort=50)
    item = PanelItem(
        id="x", domain="chat", kind="chat", score="assistant", messages=(U("q1"), A("a1", reasoning="r1"), U("q2"), A("a2"))
    )
    with pytest.raises(ChatFormatError, match="prefix-stable"):
        chat_spans(fmt, item)
