"""Run under torchrun with 2 ranks and the demo's flags: the demo (fully_shard x tensor parallel, on a
1x2 mesh), which initializes and destroys the default process group itself, so that the library
creates no group of its own; the process must exit with code 0.

The library's caches still held the destroyed world group until Python finalized it, and its exit
handler, registered only when it created a group, never ran: the group's gloo worker thread outlived
the interpreter and sometimes aborted the rank. Like `torchrun_no_destroy.py`, the script checks that
cause without its race (exit code 3 when a gloo worker thread outlives the library's exit handler).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
from helpers import exit_3_if_gloo_workers_outlive_the_library  # noqa: E402

from shardtensor.demo.cli import main  # noqa: E402

exit_3_if_gloo_workers_outlive_the_library()
sys.exit(main(sys.argv[1:]))
