"""mtcli: train, run and score Transformer machine-translation models from one config file."""

__version__ = "0.1.0"
