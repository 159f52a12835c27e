"""A 10-turn agent conversation with tools over each API, through the official `openai` and
`anthropic` clients against a real server process (issue 13): from turn 2 on, the cached tokens
cover the previous turn's prompt up to the first position the chat template rewrites, to the
token (blocks plus the tail kept where a prompt ended), and never more than an earlier request
holds.

Two templates: a plain tool template, which rewrites only the end of the previous prompt (its
generation prompt, where the scripted reply replaces the model's own), and a thinking-style one
that, like Qwen3's, shows an assistant's reasoning only after the last user message, so the
reasoning of a tool-calling turn is dropped from the prompt once the next user message arrives: a
rewrite in the middle of the previous prompt. Each turn's lost tokens (the previous prompt's tokens
after the rewrite point) are printed; the cache recomputes only those.

The tiny model writes random tokens, so the conversation's assistant turns are scripted: each
request appends the previous scripted reply (a reasoning + tool call and its result, or a reasoning
+ final answer and the next user message). The test renders every prompt with the model's own
template to know where the rewrites are, and checks that rendering against the server's count.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from toolmodel import TOOL_TEMPLATE, build_tool_model

from mlx_kvserve.server.cache_control import shared_prefix

BS = 16
TURNS = 10
MAX_TOKENS = 4

# TOOL_TEMPLATE, with an assistant's reasoning shown only after the last user message (Qwen3's rule).
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    + TOOL_TEMPLATE.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- set shown = message.role == 'assistant' and message.reasoning_content"
        " and loop.index0 > ns.last_user %}",
    )
    .replace(
        "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}",
        "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
        "{%- if shown %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{%- endif %}{{ message.content }}",
    )
    .replace(
        "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}",
        "{%- else %}<|im_start|>{{ message.role }}\n"
        "{%- if shown %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{%- endif %}{{ message.content }}",
    )
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the workspace",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name in ("read_file", "list_dir", "run_tests")
]
SYSTEM = "You are a careful coding agent. Read before you edit, run the tests after each change, and say what changed."


def openai_conversation(tag: str) -> list[list[dict]]:
    """The messages of each of the TURNS requests (OpenAI shape). Odd turns end with a tool result
    (the agent called a tool after reasoning), even turns with a new user message."""
    messages: list[dict] = [
        {"role": "system", "content": f"{tag} {SYSTEM}"},
        {"role": "user", "content": "Fix test 1."},
    ]
    requests = [list(messages)]
    for turn in range(1, TURNS):
        if turn % 2:
            call = {"path": f"src/mod{turn}.py"}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"I should look at module {turn} first.",
                    "tool_calls": [
                        {
                            "id": f"call_{turn}",
                            "type": "function",
                            "function": {"name": TOOLS[turn % 3]["function"]["name"], "arguments": json.dumps(call)},
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"def f{turn}(): return {turn}"}
            )
        else:
            messages.append(
                {"role": "assistant", "content": f"Fixed step {turn}.", "reasoning_content": f"Step {turn} passes."}
            )
            messages.append({"role": "user", "content": f"Now fix test {turn + 1}."})
        requests.append(list(messages))
    return requests


def anthropic_request(messages: list[dict]) -> tuple[str, list[dict]]:
    """The same conversation in Anthropic's shape: (system, messages)."""
    system, out = messages[0]["content"], []
    for m in messages[1:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}],
                }
            )
        else:
            blocks: list[dict] = [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""}]
            if m["content"]:
                blocks.append({"type": "text", "text": m["content"]})
            for call in m.get("tool_calls", []):
                fn = call["function"]
                blocks.append(
                    {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])}
                )
            out.append({"role": "assistant", "content": blocks})
    return system, out


def anthropic_tools() -> list[dict]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the server builds for `messages` (tool call arguments as objects, as it passes them)."""
    shaped = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        shaped.append(m)
    return list(tokenizer.apply_chat_template(shaped, tools=TOOLS, add_generation_prompt=True, tokenize=True))


@pytest.fixture(scope="module", params=["plain", "thinking"])
def agent_server(request, tmp_path_factory, start_module_server):
    template = TOOL_TEMPLATE if request.param == "plain" else THINK_TEMPLATE
    folder = build_tool_model(tmp_path_factory.mktemp(f"agent-{request.param}") / "tool-tiny", template=template)
    config = tmp_path_factory.mktemp("config") / "config.toml"
    config.write_text(f"[cache]\nblock_size = {BS}\n")
    server = start_module_server(folder, config=config)
    return request.param, server, load_tokenizer(folder)


def most_cached(prompts: list[list[int]], turn: int) -> int:
    """The most a lookup of prompts[turn] can find in what this conversation cached before it: the
    longest prefix it shares with an earlier prompt, plus that request's generated tokens (whose KV
    is cached too, all but the last) where the earlier prompt is a whole prefix of this one; and at
    most all but the prompt's last token, which is always prefilled."""
    best = 0
    for earlier in prompts[:turn]:
        shared = shared_prefix(earlier, prompts[turn])
        best = max(best, shared + (MAX_TOKENS - 1 if shared == len(earlier) else 0))
    return min(best, len(prompts[turn]) - 1)


def check_turns(kind: str, api: str, prompts: list[list[int]], totals: list[int], cached: list[int]) -> list[int]:
    """Assert the cache rule on every turn from the second; returns each turn's lost tokens.

    The server caches whole blocks plus tails kept where each prompt and each sequence ended, and
    a lookup takes the blocks a prompt shares and then the longest shared prefix of a tail. The
    first position a turn rewrites lies in the block where an earlier prompt of the conversation
    ended (the previous prompt's generation prompt, or the one that produced the dropped
    reasoning), so the cache reaches it exactly: cached >= the prefix shared with the previous
    prompt, not just its whole blocks. And never more than an earlier request holds
    (`most_cached`): where the turn rewrites inside the previous prompt that is the shared prefix
    itself, so those turns are exact."""
    assert totals == [len(p) for p in prompts], "the server rendered another prompt than the template gives"
    lost = [0]
    for turn in range(1, len(prompts)):
        previous, prompt = prompts[turn - 1], prompts[turn]
        reused = shared_prefix(previous, prompt)
        lost.append(len(previous) - reused)
        assert reused <= cached[turn] <= most_cached(prompts, turn), (kind, api, turn, reused, cached[turn])
        if lost[turn]:
            assert cached[turn] == reused, (kind, api, turn, reused, cached[turn])
    print(f"\n{kind} template, {api}: prompt / cached / lost per turn:")
    for turn, (p, c, n) in enumerate(zip(prompts, cached, lost, strict=True), 1):
        print(f"  turn {turn:2d}: {len(p):5d} / {c:5d} / {n:4d}")
    return lost


def expect_rewrites(kind: str, lost: list[int], prompts: list[list[int]]) -> None:
    """Plain: only the generation prompt's end is rewritten (a few tokens). Thinking: the turn after
    each new user message also loses the dropped reasoning, which lies inside the previous prompt."""
    if kind == "plain":
        assert max(lost[1:]) <= 12, lost
    else:
        dropped = [lost[turn] for turn in range(2, TURNS, 2)]  # requests whose last message is a user message
        assert min(dropped) > 40, lost  # the reasoning and everything after it in the previous prompt
        assert all(lost[turn] <= 12 for turn in range(1, TURNS, 2)), lost


def before_the_tag(tokenizer, prompt: list[int], other_tag: str) -> int:
    """The tokens `prompt` shares with the other API's conversation on this server (the tools, the template):
    the most its first request can find cached, since its system prompt starts with a tag of its own."""
    return shared_prefix(prompt, render(tokenizer, openai_conversation(other_tag)[0]))


def test_an_agent_conversation_over_the_openai_api(agent_server):
    kind, server, tokenizer = agent_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    requests = openai_conversation(f"[openai {kind}]")
    prompts, totals, cached = [], [], []
    for messages in requests:
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
        )
        prompts.append(render(tokenizer, messages))
        totals.append(reply.usage.prompt_tokens)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] <= before_the_tag(tokenizer, prompts[0], f"[anthropic {kind}]")  # a new system prompt
    expect_rewrites(kind, check_turns(kind, "OpenAI", prompts, totals, cached), prompts)


def test_an_agent_conversation_over_the_anthropic_api(agent_server):
    kind, server, tokenizer = agent_server
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    requests = openai_conversation(f"[anthropic {kind}]")
    prompts, totals, cached = [], [], []
    for messages in requests:
        system, shaped = anthropic_request(messages)
        reply = client.messages.create(
            model="default",
            system=system,
            messages=shaped,
            tools=anthropic_tools(),
            max_tokens=MAX_TOKENS,
            thinking={"type": "enabled", "budget_tokens": 1024},  # off without it: the template's default here
        )
        usage = reply.usage
        prompts.append(render(tokenizer, messages))
        totals.append(usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0))
        cached.append(usage.cache_read_input_tokens)
    assert cached[0] <= before_the_tag(tokenizer, prompts[0], f"[openai {kind}]")
    expect_rewrites(kind, check_turns(kind, "Anthropic", prompts, totals, cached), prompts)
