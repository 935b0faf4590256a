"""The shipped hardware profiles (`*.toml`), packaged as `hisparse_cli.profiles`: package data
read by hisparse_cli/config/profiles.py."""
