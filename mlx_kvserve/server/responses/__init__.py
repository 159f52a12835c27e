"""The OpenAI Responses API: the request translated into an OpenAI chat request (parse.py), output items
and the event stream (reply.py), stored responses (store.py), the routes (routes.py)."""
