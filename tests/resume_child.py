"""A small CEL run for tests/test_resume.py, run in a subprocess that the test kills and restarts.

Usage: python tests/resume_child.py RESULTS_DIR DATA_DIR [WRITE_DELAY_S]. The store is under $CEL_CACHE_DIR.
WRITE_DELAY_S sleeps before each store write, so that the run lasts long enough for kills to land inside it.
"""
import sys
import time

from cel_utils.config import RunConfig
from cel_utils.evaluation import store
from cel_utils.pipeline.protocol import run_cel

RUN = dict(model="random:llama:tiny", task="hellaswag", n_discovery=12, n_holdout=10, p=3, k=2, batch_size=4,
           n_random_sets=3, n_resamples=2)


def main() -> None:
    results_dir, data_dir = sys.argv[1], sys.argv[2]
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if delay:
        write = store.StoreContext._write

        def slow_write(self, *args, **kwargs):
            time.sleep(delay)  # stands in for the compute of a real model
            return write(self, *args, **kwargs)

        store.StoreContext._write = slow_write
    run = run_cel(RunConfig(**RUN, data_dir=data_dir, results_dir=results_dir), progress=False)
    print("artifact", run.artifact, flush=True)


if __name__ == "__main__":
    main()
