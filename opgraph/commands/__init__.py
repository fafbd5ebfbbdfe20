"""One module per subcommand, each with `register(subparsers)`; parsers set `func=run`."""
