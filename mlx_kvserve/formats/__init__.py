"""The text formats models write tool calls and reasoning in: markers, call syntax, how a reply is
split into reasoning, content and calls. A leaf package (it imports only config and errors): the engine
reads it to build grammars (engine/sampling/tool_grammar.py), the server to parse replies.

- reasoning.py: the think markers and where a prompt leaves the reply (inside a block or not)
- tool_calls.py: the tools a request offers, the call markers, the call syntax a grammar writes, parsing
- output.py: a streamed reply split into Segments (content, reasoning, tool calls)
"""
