"""The one error a config mistake raises, shared by the loader and the launch dialects."""


class ConfigError(ValueError):
    """A mistake in config files, command-line arguments or values; the message says what to change."""
