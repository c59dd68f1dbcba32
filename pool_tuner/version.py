"""pool_tuner's version, in a module of its own so that modules below the package's ``__init__``
(the tuning cache records it) can import it without importing the whole package."""

__version__ = "0.1.0"
