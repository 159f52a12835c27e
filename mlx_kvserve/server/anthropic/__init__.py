"""The Anthropic Messages API: the request translated into an OpenAI chat request (parse.py, with
Claude Code's context edits in context.py), the reply and its event stream (reply.py), the routes
(routes.py)."""
