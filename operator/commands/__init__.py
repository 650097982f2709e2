"""Subcommands of the `gearshift` CLI beside `generate`: worker, router, serve."""
