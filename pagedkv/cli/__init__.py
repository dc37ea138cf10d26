"""The `pagedkv` command line.

commands.py assembles the click group (the console entry point) from its commands,
storecommands.py and runcommands.py; exits.py holds the exit codes and the handling of
failures, options.py what the commands share; text.py escapes and formats, storetext.py
and demotext.py lay out the reports.
"""
