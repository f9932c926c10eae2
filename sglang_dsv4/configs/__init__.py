"""Architecture configs shipped with the package (``config.json`` style, no weights)."""
