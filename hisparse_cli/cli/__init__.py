"""The `hisparse` command line: the Typer app (app.py) and one module per command group;
thin commands that parse flags and call library functions."""
