"""Costs (communication per mesh axis, compute) and the placement solver."""
