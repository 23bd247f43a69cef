"""The HTTP edge: the ASGI app, request bodies and their schema, errors, exposure."""
