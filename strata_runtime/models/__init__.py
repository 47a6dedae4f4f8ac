"""Model architectures, one module per checkpoint ``model_type``."""
