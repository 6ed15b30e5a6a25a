"""Greedy decoding and beam search: agreement, scores, a case where beam search wins, errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from companion.models.beam_search import beam_search, greedy_decode, length_penalty
from companion.models.config import ModelConfig
from companion.models.seq2seq import Seq2SeqTransformer

PAD, BOS, EOS = 0, 1, 2
IDS = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}
V = 13


def random_model(seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=16,
        norm_placement="post",
        activation="relu",
        position="sinusoidal",
        scale_embeddings=True,
    )
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # make EOS likely enough that some hypotheses end early
        model.tok_emb.weight[EOS] *= 3.0
    return model


def source(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (5, 6), generator=g)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, 3:] = mask[3, 5:] = False
    return src.masked_fill(~mask, PAD), mask


def teacher_forced_logprob(model, src, mask, tokens: Tensor) -> Tensor:
    """Sum of log p(token) along ``tokens (B, L)`` up to and including EOS."""
    tgt_in = torch.cat([torch.full((tokens.shape[0], 1), BOS), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logp = F.log_softmax(model(src, tgt_in, mask).float(), dim=-1)
    per_tok = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (B, L)
    is_eos = (tokens == EOS).int()
    alive = (is_eos.cumsum(-1) - is_eos) == 0  # up to and including the first EOS
    return (per_tok * alive).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_of_width_one_is_greedy(seed):
    model = random_model(seed)
    src, mask = source(seed)
    g = greedy_decode(model, src, mask, max_len=10, **IDS)
    b = beam_search(model, src, mask, max_len=10, beam_size=1, alpha=0.6, **IDS)
    assert torch.equal(g.tokens, b.tokens)
    torch.testing.assert_close(g.scores, b.scores)
    assert torch.equal(g.lengths, b.lengths)


def test_scores_are_the_teacher_forced_log_probabilities():
    model = random_model(0)
    src, mask = source(0)
    g = greedy_decode(model, src, mask, max_len=10, **IDS)
    torch.testing.assert_close(
        g.scores, teacher_forced_logprob(model, src, mask, g.tokens)
    )
    b = beam_search(model, src, mask, max_len=10, beam_size=3, alpha=0.0, **IDS)
    for k in range(3):
        got = teacher_forced_logprob(model, src, mask, b.beams[:, k])
        torch.testing.assert_close(b.beam_scores[:, k], got, atol=1e-4, rtol=1e-5)
    assert (
        b.beam_scores[:, :-1] >= b.beam_scores[:, 1:]
    ).all()  # α = 0: best raw score first


def test_after_eos_only_padding():
    model = random_model(1)
    src, mask = source(1)
    b = beam_search(model, src, mask, max_len=10, beam_size=4, **IDS)
    for beam in b.beams.reshape(-1, b.beams.shape[-1]).tolist():
        if EOS in beam:
            assert all(t == PAD for t in beam[beam.index(EOS) + 1 :])
            assert PAD not in beam[: beam.index(EOS)]


def test_batched_beam_equals_one_source_at_a_time():
    model = random_model(2)
    src, mask = source(2)
    batched = beam_search(model, src, mask, max_len=8, beam_size=3, **IDS)
    for i in range(src.shape[0]):
        one = beam_search(
            model, src[i : i + 1], mask[i : i + 1], max_len=8, beam_size=3, **IDS
        )
        n = one.tokens.shape[1]
        assert batched.tokens[i, :n].tolist() == one.tokens[0].tolist()
        torch.testing.assert_close(
            batched.scores[i], one.scores[0], atol=1e-5, rtol=1e-5
        )


class MarkovModel:
    """A fake encoder-decoder whose next-token distribution depends on the last token only."""

    def __init__(self, probs: dict[int, dict[int, float]]) -> None:
        self.table = torch.full((7, 7), 1e-6)
        for last, row in probs.items():
            for tok, p in row.items():
                self.table[last, tok] = p
        self.table = self.table.log()

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        return torch.zeros(src.shape[0], src.shape[1], 1)

    def decode(
        self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None = None
    ) -> Tensor:
        return self.table[tgt_in]  # (B, T, V)


def test_beam_search_finds_a_more_probable_sequence_than_greedy():
    a, b, c, d = 3, 4, 5, 6
    model = MarkovModel(
        {
            BOS: {a: 0.5, b: 0.4, c: 0.1},
            a: {
                c: 0.34,
                d: 0.33,
                EOS: 0.33,
            },  # greedy's first choice leads nowhere certain
            b: {EOS: 0.95, c: 0.05},  # the second choice ends with near certainty
            c: {EOS: 1.0},
            d: {EOS: 1.0},
        }
    )
    src = torch.zeros(1, 2, dtype=torch.long)
    g = greedy_decode(model, src, max_len=5, **IDS)
    bs = beam_search(model, src, max_len=5, beam_size=2, alpha=0.0, **IDS)
    assert g.tokens[0].tolist()[:3] == [a, c, EOS]
    assert bs.tokens[0].tolist()[:2] == [b, EOS]
    assert bs.scores[0] > g.scores[0]
    assert math.isclose(bs.scores[0].exp().item(), 0.4 * 0.95, rel_tol=1e-4)


def test_length_penalty_can_prefer_a_longer_hypothesis():
    a, b = 3, 4
    model = MarkovModel(
        {
            BOS: {EOS: 0.35, a: 0.65},
            a: {b: 0.6, EOS: 0.4},
            b: {EOS: 0.7, a: 0.3},
        }
    )
    src = torch.zeros(1, 2, dtype=torch.long)
    raw = beam_search(model, src, max_len=6, beam_size=3, alpha=0.0, **IDS)
    long = beam_search(model, src, max_len=6, beam_size=3, alpha=3.0, **IDS)
    assert raw.lengths[0] < long.lengths[0]
    assert raw.scores[0] > long.scores[0]
    torch.testing.assert_close(
        length_penalty(torch.tensor([1, 7]), 0.6)[0], torch.tensor(1.0)
    )
    assert length_penalty(torch.tensor([3]), 0.0).item() == 1.0


def test_stops_at_max_len_without_eos():
    model = MarkovModel({BOS: {3: 1.0}, 3: {3: 1.0}})
    src = torch.zeros(2, 2, dtype=torch.long)
    out = greedy_decode(model, src, max_len=4, **IDS)
    assert out.tokens.tolist() == [[3, 3, 3, 3]] * 2 and out.lengths.tolist() == [4, 4]
    out = beam_search(model, src, max_len=4, beam_size=2, **IDS)
    assert out.tokens.shape == (2, 4) and out.lengths.tolist() == [4, 4]


def test_errors():
    model = random_model()
    src, mask = source()
    with pytest.raises(ValueError, match="src must have shape"):
        greedy_decode(model, src[0], max_len=4, **IDS)
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(model, src, mask, max_len=0, **IDS)
    with pytest.raises(ValueError, match="must differ"):
        greedy_decode(model, src, mask, max_len=4, bos_id=1, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        beam_search(model, src, mask, max_len=4, beam_size=0, **IDS)
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        beam_search(model, src, mask, max_len=4, beam_size=2.0, **IDS)
    with pytest.raises(ValueError, match="alpha"):
        beam_search(model, src, mask, max_len=4, alpha=-1.0, **IDS)
    with pytest.raises(ValueError, match="at most the vocabulary size"):
        beam_search(model, src, mask, max_len=4, beam_size=V + 1, **IDS)
