"""One module per CLI subcommand, each exposing `command` (a click.Command)."""
