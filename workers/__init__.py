"""The bundled worker engine (needs torch: ``pip install mesh-router[engine]``)."""
