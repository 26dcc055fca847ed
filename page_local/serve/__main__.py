"""`python -m page_local.serve`: `page-local serve` without the console script (the same command)."""

from page_local.cli.serve import serve_cmd

serve_cmd(prog_name="page-local serve")
