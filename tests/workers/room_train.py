"""train.py with the learner's GPU memory stood in by a file, "<free GiB> <total GiB>" (learner.free_memory reads it),
which tests/test_train.py's stand-in inference server rewrites once it is ready, as a server sharing the GPU takes
its memory once loaded:

    python tests/workers/room_train.py ROOM_FILE [train.py's arguments]
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from l0_min import learner  # noqa: E402

room = Path(sys.argv[1])
learner.free_memory = lambda device: tuple(float(x) for x in room.read_text().split())
sys.argv = [str(ROOT / "train.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
