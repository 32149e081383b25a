"""Parallelism: device meshes and how arrays are laid out on them."""
