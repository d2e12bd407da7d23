"""Serving a user's checkpoint larger than memory: `load_offloaded`, `tensorbend generate`, the
model built without its experts, the expert stores, and the baseline without tensorbend."""
