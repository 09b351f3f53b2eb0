"""The wire formats the TITO proxy speaks, over one turn pipeline (``Session.complete``).

Each API translates its request into the internal ``ChatCompletionRequest`` (messages, tools, sampling) and
the recorded turn back into its own response and stream events: ``chat`` (OpenAI Chat Completions),
``responses`` (OpenAI Responses), ``anthropic`` (Anthropic Messages). ``streaming`` runs a streamed turn for
all of them. So turns of any API land in the same session tree with the same exact tokens.
"""
