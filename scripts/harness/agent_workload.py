"""The agent workload, deterministic and pure: a Qwen-style tool template (what the agent model of
agent_model.py renders with), 20 tool schemas, long agent instructions and the user turns of the
Claude Code session (agents.py session), so that every server gets the same requests."""

from __future__ import annotations

from typing import Any

# Qwen2.5's layout: the tools go into the system turn, an assistant's calls are <tool_call> JSON, a tool
# result is a user turn in <tool_response>. No thinking block (SmolLM2 has no think tokens). mlx-lm infers
# its json_tools parser from "<tool_call>" and "tool_call.name" in the template. Text is written by
# expressions: transformers renders with trim_blocks, which would eat a newline written after a tag.
TOOL_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
  {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
  {{- '\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in rest %}
  {%- if message.role == 'assistant' and message.tool_calls %}
    {{- '<|im_start|>assistant\n' + message.content }}
    {%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
      {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) }}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


# (name, description, [(parameter, JSON type, description, required)])
# fmt: off
_TOOLS: list[tuple[str, str, list[tuple[str, str, str, bool]]]] = [
    ("read_file", "Read a text file of the repository.", [
        ("path", "string", "Path relative to the repository root.", True),
        ("start_line", "integer", "First line to return (1-based).", False),
        ("end_line", "integer", "Last line to return, inclusive.", False)]),
    ("write_file", "Create or overwrite a file with the given content.", [
        ("path", "string", "Path relative to the repository root.", True),
        ("content", "string", "The full new content of the file.", True)]),
    ("edit_file", "Replace one exact occurrence of a string in a file.", [
        ("path", "string", "Path relative to the repository root.", True),
        ("old", "string", "The exact text to replace; must occur once.", True),
        ("new", "string", "The replacement text.", True)]),
    ("list_directory", "List the entries of a directory.", [
        ("path", "string", "Directory relative to the repository root.", True),
        ("recursive", "boolean", "Also list subdirectories.", False)]),
    ("search_code", "Search the repository for a regular expression.", [
        ("pattern", "string", "A regular expression.", True),
        ("glob", "string", "Only files matching this glob, e.g. '*.py'.", False),
        ("max_results", "integer", "At most this many matches.", False)]),
    ("run_tests", "Run the test suite or a part of it and return the summary.", [
        ("path", "string", "A test file or directory.", True),
        ("pattern", "string", "Only tests whose name matches this expression.", False),
        ("timeout_s", "integer", "Stop the run after this many seconds.", False)]),
    ("run_shell", "Run a shell command in the repository and return its output.", [
        ("command", "string", "The command line.", True),
        ("timeout_s", "integer", "Stop the command after this many seconds.", False)]),
    ("git_status", "Show the working tree status.", []),
    ("git_diff", "Show the changes of the working tree or of one file.", [
        ("path", "string", "Only this file.", False),
        ("staged", "boolean", "Show staged changes instead.", False)]),
    ("git_commit", "Commit the named files with a message.", [
        ("paths", "array", "Files to commit.", True),
        ("message", "string", "The commit message.", True)]),
    ("http_get", "Fetch a URL and return the response body as text.", [
        ("url", "string", "An http or https URL.", True),
        ("headers", "object", "Extra request headers.", False)]),
    ("web_search", "Search the web and return the top results.", [
        ("query", "string", "The search query.", True),
        ("num_results", "integer", "How many results to return (1-10).", False)]),
    ("create_issue", "Open an issue in the project's tracker.", [
        ("title", "string", "A one-line summary.", True),
        ("body", "string", "The description, in Markdown.", True),
        ("labels", "array", "Labels to attach.", False)]),
    ("comment_issue", "Add a comment to an issue or pull request.", [
        ("number", "integer", "The issue or pull request number.", True),
        ("body", "string", "The comment, in Markdown.", True)]),
    ("query_database", "Run a read-only SQL query on the staging database.", [
        ("sql", "string", "One SELECT statement.", True),
        ("max_rows", "integer", "At most this many rows.", False)]),
    ("read_logs", "Read recent log lines of a service.", [
        ("service", "string", "The service name.", True),
        ("level", "string", "Minimum level: debug, info, warning or error.", False),
        ("since_minutes", "integer", "Only lines from the last N minutes.", False)]),
    ("send_message", "Send a chat message to a team channel.", [
        ("channel", "string", "The channel name, without '#'.", True),
        ("text", "string", "The message.", True)]),
    ("schedule_job", "Schedule a one-off job on the CI runners.", [
        ("workflow", "string", "The workflow file name.", True),
        ("ref", "string", "Branch, tag or commit to run on.", True),
        ("inputs", "object", "Workflow inputs.", False)]),
    ("calculator", "Evaluate an arithmetic expression exactly (decimal arithmetic).", [
        ("expression", "string", "The expression, e.g. '(40.00 - 0.01) * 3'.", True)]),
    ("ask_user", "Ask the user a question and wait for the answer.", [
        ("question", "string", "One clear question.", True)]),
]
# fmt: on


def tool_schemas(n: int = 20) -> list[dict[str, Any]]:
    """The first `n` (at most 20) tools as OpenAI function tools, each a JSON schema of its arguments."""
    tools = []
    for name, description, params in _TOOLS[:n]:
        properties: dict[str, Any] = {}
        for param, kind, text, _ in params:
            properties[param] = {"type": kind, "description": text}
            if kind == "array":
                properties[param]["items"] = {"type": "string"}
        required = [p for p, _, _, req in params if req]
        schema = {"type": "object", "properties": properties, "required": required}
        tools.append({"type": "function", "function": {"name": name, "description": description, "parameters": schema}})
    return tools


# fmt: off
_AREAS = [
    "the payments service", "the billing API", "the web client", "the database migrations",
    "the CI configuration", "the deployment scripts", "the authentication module", "the search indexer",
    "the notification worker", "the reporting jobs", "the mobile API gateway", "the feature-flag service",
]
# fmt: on
_RULES = [
    "Before you change {area}, read the files involved with `{tool}` and state your plan in one or two sentences.",
    "When a test in {area} fails, run it alone first, read the assertion and the code it covers, then fix the cause, "
    "not the test.",
    "Use `{tool}` only when it is the simplest way to get the fact you need; never call a tool to guess.",
    "Keep every change to {area} as small as the fix allows and leave unrelated code exactly as it is.",
    "Money in {area} is held as integer cents or decimal values, never binary floats; round half to even at the end.",
    "If a command in {area} could delete data or touch production, stop and ask the user with `ask_user` first.",
    "After an edit to {area}, run the tests that cover it with `run_tests` and report the summary line verbatim.",
    "Quote file paths and line numbers when you explain a finding about {area}, so the reviewer can follow it.",
    "Do not commit secrets, tokens or customer data found in {area}; mention that you saw them and where.",
    "Write commit messages for {area} in the imperative mood, under 72 characters, with the reason in the body.",
    "When the logs of {area} disagree with the code, trust the code at the deployed commit and say so.",
    "Answer in short paragraphs; use a list only for steps the user must follow in {area}.",
]


def agent_instructions(nonce: str, num_words: int) -> str:
    """Agent instructions of about `num_words` words: rules about the tools and the code areas, cycled
    deterministically. `nonce` opens the text, so a new nonce makes a prompt no server has seen."""
    names = [t[0] for t in _TOOLS]
    lines = [
        f"Session {nonce}." if nonce else "Session.",
        "You are a senior software engineer working as a coding agent in the company's main repository.",
        "You act through the tools listed below and answer the user directly when no tool is needed.",
        "",
        "## Rules",
    ]
    i, words = 0, sum(len(line.split()) for line in lines)
    while words < num_words:
        rule = _RULES[i % len(_RULES)].format(area=_AREAS[(i // len(_RULES)) % len(_AREAS)], tool=names[i % len(names)])
        lines.append(f"{i + 1}. {rule}")
        words += len(lines[-1].split())
        i += 1
    return "\n".join(lines)


USER_TURNS = [
    "CI failed on main for the payments service. Find out why.",
    "Which test fails, and what does it assert?",
    "Show me the code that computes the refund.",
    "Why is it off by one cent?",
    "Fix it with decimal arithmetic, please.",
    "Run the refund tests again.",
    "Are there other places in the service that use floats for money?",
    "Fix the invoice total the same way.",
    "Run the whole payments suite.",
    "Commit both fixes with a good message.",
]
