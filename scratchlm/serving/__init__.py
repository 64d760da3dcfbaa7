"""Serving a trained model: OpenAI's completions API (and its chat completions, for a chat model) and a web
page, with batched generation.

- `engine.py`: the scheduler thread that runs the model for every request in flight, one token per step for
  all of them (continuous batching over a `PaddedKVCache`).
- `api.py`: the Starlette app: the API's schema, limits and errors, streaming, the page's routes.
- `requests.py`: each request checked in full (a chat request becomes the completion of its templated
  conversation); `shapes.py`: the answers written as completions or as chat completions; `tokenization.py`:
  the tokenizer's endpoints; `text.py`: a completion's text as its tokens arrive, cut at its stop strings.
- `server.py`: the uvicorn server around them, and a clean stop on Ctrl-C or SIGTERM.
- `static/`: the page (HTML, CSS, JavaScript), shipped in the package; it loads nothing else.

Starlette and uvicorn are the optional extra `scratchlm[serve]`; `scratchlm serve` is the way in. The design,
the cache layout and the limits are described in docs/serving.md.
"""
