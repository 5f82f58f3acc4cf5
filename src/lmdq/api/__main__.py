from lmdq.cli.api import main

main()
