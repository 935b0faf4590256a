"""Configuration: the frozen run settings (settings.py: SparseConfig, GenerationConfig) and
the hardware profiles loader (profiles.py, reading the packaged `hisparse_cli.profiles`)."""
