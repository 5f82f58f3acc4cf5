"""Command-line plumbing shared by lmdq's CLIs: the only package that may import typer."""
