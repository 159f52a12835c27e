"""`mlx-kvserve launch CLIENT`: an agent client (Claude Code, Codex, opencode, Qwen Code, Cline, aider,
llm) pointed at this server with no hand-written configuration.

target.py finds the server (or server.py starts one), clients.py says per client what to set (a
Profile: environment, files in a private folder under <home>/launch/CLIENT, the command), and
command.py writes the profile and runs the client. The user's own configuration is never edited:
each client is pointed at its private folder through its own variable (CODEX_HOME, CLAUDE_CONFIG_DIR,
OPENCODE_CONFIG, QWEN_HOME, CLINE_DIR, LLM_USER_PATH) or given flags.
"""
