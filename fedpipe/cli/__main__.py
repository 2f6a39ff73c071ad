"""`python -m fedpipe.cli`: the `fedpipe` command."""

from fedpipe.cli import main

main()
