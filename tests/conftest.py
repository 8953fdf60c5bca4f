import os
import sys
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))  # test helpers (harness modules) import by name
