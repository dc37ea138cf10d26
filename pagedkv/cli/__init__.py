"""The `pagedkv` command line: click commands (commands.py) and their text rendering (text.py)."""
