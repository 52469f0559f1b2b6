"""distlearn's benchmark suite: `python -m bench` (see bench/run.py and bench/RESULTS.md)."""
