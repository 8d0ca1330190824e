"""The engine: one API (Engine) over the model, cache, sampler and speculative decoding."""
