"""Command-line tools: `python -m metrale_graph.tools.<name> --help`."""
