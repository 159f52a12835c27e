"""The measurements bench.py runs together on one pair of servers and each single-topic bench runs alone."""
