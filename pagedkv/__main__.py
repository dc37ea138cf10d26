"""``python -m pagedkv``: the command line."""

from .cli.commands import cli

if __name__ == "__main__":
    cli(prog_name="pagedkv")
