"""Graph passes. Each file defines one pass named after it; `spmd.pipeline` lists them in order."""
