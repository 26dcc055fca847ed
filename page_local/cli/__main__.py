"""`python -m page_local.cli`: the `page-local` command without its console script."""

from page_local.cli import main

main(prog_name="page-local")
