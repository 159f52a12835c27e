"""scripts/bench_agent.py without servers: its tools, instructions and scripted conversation, the tool
template they render through, the streamed reply it times, and its summary arithmetic and report
(scripts/harness: agent_workload.py, clients.py, agent_summary.py)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from harness import OURS, THEIRS, agent_summary, agent_workload, clients
from harness.agent_summary import FULL
from harness.agent_workload import ASSISTANT_TURNS, USER_TURNS, agent_instructions, tool_schemas, turn_messages


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def render(tokenizer, messages, tools) -> str:
    return tokenizer.apply_chat_template(
        agent_workload.template_input(messages),
        tools=tools,
        chat_template=agent_workload.TOOL_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )


def test_tool_schemas_are_function_tools_with_object_schemas():
    tools = tool_schemas()
    names = [t["function"]["name"] for t in tools]
    assert len(tools) == 20 and len(set(names)) == 20
    for tool in tools:
        schema = tool["function"]["parameters"]
        assert tool["type"] == "function" and schema["type"] == "object"
        assert set(schema["required"]) <= set(schema["properties"])
    assert [t["function"]["name"] for t in tool_schemas(3)] == names[:3]


def test_instructions_are_deterministic_about_the_asked_size_and_open_with_the_nonce():
    a = agent_instructions("a", 1000)
    assert a == agent_instructions("a", 1000) and a.startswith("Session a.\n")
    assert agent_instructions("b", 1000).split("\n", 1)[1] == a.split("\n", 1)[1]  # only the nonce differs
    assert 1000 <= len(a.split()) <= 1040
    assert "`run_tests`" in a and "the billing API" in a


def test_each_turn_extends_the_last_by_its_assistant_part_and_a_user_message():
    assert len(USER_TURNS) == 10 and len(ASSISTANT_TURNS) == 9
    first = turn_messages("S", 0)
    assert first == [{"role": "system", "content": "S"}, {"role": "user", "content": USER_TURNS[0]}]
    for turn in range(1, 10):
        before, now = turn_messages("S", turn - 1), turn_messages("S", turn)
        assert now == [*before, *ASSISTANT_TURNS[turn - 1], {"role": "user", "content": USER_TURNS[turn]}]
    calls = [m for m in turn_messages("S", 9) if m.get("tool_calls")]
    results = [m for m in turn_messages("S", 9) if m["role"] == "tool"]
    assert len(calls) == len(results) == 7
    assert [c["tool_calls"][0]["id"] for c in calls] == [r["tool_call_id"] for r in results]
    for call in calls:
        json.loads(call["tool_calls"][0]["function"]["arguments"])  # OpenAI sends arguments as JSON text
    with pytest.raises(ValueError):
        turn_messages("S", 10)


def test_the_template_puts_tools_in_the_system_turn_and_each_prompt_prefixes_the_next(tokenizer):
    tools = tool_schemas(2)
    texts = [render(tokenizer, turn_messages("Rules.", t), tools) for t in range(10)]
    system_turn = texts[0].split("<|im_end|>")[0]
    assert system_turn.startswith("<|im_start|>system\nRules.\n\n# Tools")
    assert json.dumps(tools[1]) in system_turn
    assert texts[0].endswith(f"<|im_start|>user\n{USER_TURNS[0]}<|im_end|>\n<|im_start|>assistant\n")
    assert '<tool_call>\n{"name": "run_tests", "arguments": {"path": "services/payments"}}\n</tool_call>' in texts[1]
    assert "<|im_start|>user\n<tool_response>\nFAILED tests/test_refund.py" in texts[1]
    for turn in range(1, 10):  # what a prefix cache can reuse: the whole previous prompt
        assert texts[turn].startswith(texts[turn - 1])
    without = render(tokenizer, turn_messages("Rules.", 0), None)
    assert "# Tools" not in without and without.startswith("<|im_start|>system\nRules.<|im_end|>\n")


def test_mlx_lm_reads_json_tool_calls_from_the_template():
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    fake = SimpleNamespace(chat_template=agent_workload.TOOL_TEMPLATE, get_vocab=dict)
    assert _infer_tool_parser(fake) == "json_tools"


@pytest.mark.slow
def test_full_workload_fits_smollm2_with_a_6k_system_turn(smollm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    tools = tool_schemas(FULL.num_tools)
    system = agent_instructions("x", FULL.instruction_words)
    system_tokens = agent_workload.count_tokens(tok, [{"role": "system", "content": system}], tools)
    assert 5500 <= system_tokens <= 6500, system_tokens
    last = agent_workload.count_tokens(tok, turn_messages(system, FULL.turns - 1), tools)
    assert last + FULL.max_tokens <= 8192, last  # SmolLM2's context


def _stream(lines: list[str]):
    @contextmanager
    def fake(method, url, json, timeout):
        fake.body = json
        yield SimpleNamespace(raise_for_status=lambda: None, iter_lines=lambda: iter(lines))

    return fake


def test_stream_turn_times_the_first_delta_and_reads_usage(monkeypatch):
    usage = {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}}
    lines = [
        'data: {"choices": [{"delta": {"role": "assistant"}}]}',
        'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}',
        'data: {"choices": [{"delta": {"content": "x"}}]}',
        f'data: {{"choices": [], "usage": {json.dumps(usage)}}}',
        "data: [DONE]",
    ]
    fake = _stream(lines)
    monkeypatch.setattr(clients.httpx, "stream", fake)
    server = SimpleNamespace(name=OURS, url="http://x")
    reply = clients.stream_turn(server, [{"role": "user", "content": "hi"}], tool_schemas(1), 4)
    assert reply.prompt_tokens == 120 and reply.cached_tokens == 96 and reply.first == "tool_calls"
    assert 0 <= reply.ttft_s < 1
    assert fake.body["model"] == "default" and fake.body["tools"] == tool_schemas(1) and fake.body["stream"]
    monkeypatch.setattr(clients.httpx, "stream", _stream(['data: {"choices": [], "usage": {"prompt_tokens": 5}}']))
    reply = clients.stream_turn(SimpleNamespace(name=THEIRS, url="http://x"), [], [], 4)
    assert reply.first == "none" and reply.cached_tokens is None and reply.prompt_tokens == 5


def _turn(tokens: int, ours: float, theirs: float, cached: int | None = 0) -> dict:
    reply = {"prompt_tokens": tokens, "cached_tokens": cached, "first": "content"}
    return {OURS: {**reply, "ttft_s": ours}, THEIRS: {**reply, "ttft_s": theirs}}


def test_cold_reference_is_the_line_through_the_two_measured_colds():
    assert agent_summary.cold_reference([(1000, 10.0), (2000, 30.0)], 1500) == 20.0
    assert agent_summary.cold_reference([(1000, 10.0), (2000, 30.0)], 2500) == 40.0  # extrapolated
    assert agent_summary.cold_reference([(1000, 10.0), (1000, 12.0)], 1500) == 15.0  # one length: through 0


def test_summary_ratios_per_turn_and_over_the_run():
    turns = [_turn(1000, 10.0, 15.0), _turn(1100, 1.0, 3.0, 1000), _turn(1200, 2.0, 2.0, 1100)]
    s = agent_summary.summarize(turns, (2000, 20.0))
    rows = s["rows"]
    assert [r["cold_s"] for r in rows] == [10.0, pytest.approx(11.0), pytest.approx(12.0)]
    assert rows[0]["vs_cold"] == 1.0 and rows[0]["vs_theirs"] == 1.5
    assert rows[1]["vs_cold"] == pytest.approx(11.0) and rows[1]["vs_theirs"] == 3.0
    assert rows[2]["vs_cold"] == pytest.approx(6.0) and rows[2]["vs_theirs"] == 1.0
    assert s["run"]["vs_cold"] == pytest.approx(23.0 / 3) and s["run"]["vs_theirs"] == pytest.approx(5.0 / 3)
    assert s["met"] == {"per_turn_cold": True, "per_turn_theirs": False, "run_cold": True, "run_theirs": False}
    slow = agent_summary.summarize([*turns[:2], _turn(1200, 3.0, 20.0)], (2000, 20.0))
    assert slow["met"] == {"per_turn_cold": False, "per_turn_theirs": True, "run_cold": True, "run_theirs": True}


def test_report_rows_and_target_lines():
    turns = [_turn(1000, 10.0, 15.0), _turn(1100, 1.0, 3.0, 1000)]
    turns[1][THEIRS]["prompt_tokens"] = 1101
    results = {
        "params": FULL._asdict(),
        "system_tokens": 990,
        "full_cold": [2000, 20.0],
        "wall_s": 600.0,
        "conversations": {"no restart": {"turns": turns}},
    }
    report = "\n".join(agent_summary.report_lines(results))
    assert "System turn 990 tokens (20 tool schemas), 10 turns" in report and "Wall time 10.0 min" in report
    assert "| 1 | 1000 | 0 / 0 | 10.00 | 15.00 | 10.00 | 1.0x | 1.50x |" in report
    assert "| 2 | 1100 (prompts differ) | 1000 / 1000 | 1.00 | 3.00 | 11.00 | 11.0x | 3.00x |" in report
    assert "cold / ours 11.0x at least (>= 5x per turn: met), 11.0x over the run (met)" in report
    assert "theirs / ours 3.00x at least (>= 2x per turn: met), 3.00x over the run (met)" in report
    assert "First deltas" not in report
