"""Layer 4: the typed run configuration and the TRL engine's settings derived from it.

``schema`` declares the sections, each field with its help text and constraints (``fields.setting``);
``fields`` holds the constraint words and the one loop that checks every field; ``loading`` reads YAML files,
``--set`` overrides and the built-in defaults into a ``Config``; ``validation`` runs that loop, the rules between
fields and the method's check (which builds the method once); ``trl`` derives TRL's ``GRPOConfig``.
"""
