from lmdq.cli.producer import main

if __name__ == "__main__":
    main()
