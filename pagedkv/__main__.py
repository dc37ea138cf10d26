"""``python -m pagedkv``: the command line."""

from .cli import cli

if __name__ == "__main__":
    cli(prog_name="pagedkv")
