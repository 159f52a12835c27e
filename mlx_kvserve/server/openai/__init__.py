"""The OpenAI API: chat and text completion requests parsed (parse.py, tools.py, logprobs.py), their
replies whole (reply.py) or streamed (stream.py), `n` choices (choices.py), and the routes (routes.py)."""
