from lmdq.worker.cli import main

# LMDeploy's PyTorch engine spawns processes: the entry module must be import-safe.
if __name__ == "__main__":
    main()
