"""What runs on each rank: the collective helpers the generated graphs call, and the compiled module."""
