import os
import sys

# Shared test helpers (toy_models.py) live next to this file; spawned worker
# processes inherit sys.path, so they can import them too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
