"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a
list of choices or a grammar, with xgrammar.

`params` holds the request's constraint (it travels in SamplingParams) and has no
heavy imports; `grammar` turns a constraint into an xgrammar grammar, or a clear
error, for the API server's check and the engine's compile alike; `manager` is the
engine core's side (compiles off the loop, one matcher per request, the token masks
of a step); `bitmask` applies those masks to the logits in the sampler.
"""
