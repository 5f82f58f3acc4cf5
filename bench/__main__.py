from lmdq.cli.bench import main

if __name__ == "__main__":
    main()
