from trainer.sft.cpu_threads import apply_omp_wait_policy

apply_omp_wait_policy()  # before anything loads torch: the OpenMP runtime reads it once

from trainer.cli import main  # noqa: E402
from trainer.launch.worker_exit import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
