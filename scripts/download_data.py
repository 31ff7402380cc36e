"""Fetches the data of fastpos tasks into one data root, on a machine with internet.

  python scripts/download_data.py TASK... --data_dir DIR [--dry_run] [--delete_archives]
  python scripts/download_data.py --dry_run [--data_dir DIR]   # the plan for every task
  python scripts/download_data.py --list

The command line of ``fastpos.tasks.download`` (its docstring has the details). It imports
``fastpos.tasks.paths`` and the standard library only (numpy, no jax), so it runs in the
separate environment that preparing tfds datasets needs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fastpos

from fastpos.tasks.download import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
