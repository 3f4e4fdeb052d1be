"""Measurements taken on every rank: time, memory, communication, FLOPs."""
