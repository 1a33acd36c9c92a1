from trainer.cli import main
from trainer.launch.worker_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
