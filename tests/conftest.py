import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
