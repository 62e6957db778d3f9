"""``pagestream gateway``: the OpenAI-compatible HTTP server, a producer like any other."""
