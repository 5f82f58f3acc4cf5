from lmdq.api.cli import main

main()
