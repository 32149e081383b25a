"""The grouped matmul of rows sorted by expert against FP8 or FP4 experts as stored."""
