"""Command-line tools: `python -m tools.<name> --help`."""
