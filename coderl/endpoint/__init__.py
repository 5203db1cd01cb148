"""The OpenAI-compatible endpoint, below its two users: ``coderl serve`` (:mod:`coderl.online`)
and the gateway environment (:mod:`coderl.envs.gateway`).

- :mod:`coderl.endpoint.request`: what a request may carry (honoured fields, fields accepted at
  a neutral value, refusals in one line) and the message rules;
- :mod:`coderl.endpoint.chat`: the request path (rendering, sampling, ``stop``,
  ``parallel_tool_calls``, the reply and its stream) and the segmenter of an episode's calls;
- :mod:`coderl.endpoint.errors`: every error in OpenAI's shape (unknown paths included);
- :mod:`coderl.endpoint.calls`: the harness's tools and call formats on the served side;
- :mod:`coderl.endpoint.batching`: concurrent requests batched for an in-process sampler;
- :mod:`coderl.endpoint.http`: an app served by uvicorn in a background thread.
"""
