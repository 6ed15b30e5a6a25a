"""Data: the Shakespeare text and its tokenizers, the translation toy, synthetic
tasks."""
