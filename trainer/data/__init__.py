"""Data: sources, tokenizing (here or on the cluster), the token cache, packed blocks,
document attention and mixing."""
