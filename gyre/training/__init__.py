"""Cell training loop, dynamic data parallelism, prefix communication groups, core optimizer."""
