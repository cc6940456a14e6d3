"""Graph passes. Each file defines one pass named after it; `spmd.compiler.pipeline` lists them in order."""
