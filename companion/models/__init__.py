"""Configs, builders and whole models: the decoder LM, the encoder, the 2017 seq2seq,
and generation (cached decoding, beam search)."""
