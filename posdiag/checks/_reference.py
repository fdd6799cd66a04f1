"""Teacher-forced references for `generate`: the forward's logits at the positions generate() produced, for each
generated row alone, and the noise floor of that comparison. Only the compared positions go through the LM head
(logits_to_keep where the model takes it): a [T, vocab] output per row is never kept.
"""

from __future__ import annotations

import torch

from posdiag.model.jitter import jittered
from posdiag.model.outputs import output_of
from posdiag.model.probe import logits_at
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2

JITTER_SOURCE = ("the teacher-forced forward of one generated row with its token embeddings jittered by ~1 ulp, at the "
                 "generated positions (max per position): the short prompt prefixes reproduced it bit for bit")
FLOOR_POSITIONS = 16  # positions of the short prefixes the floor compares (all of them when fewer)
PADDING_SHARE = 0.25  # of a reference forward's tokens, at most this share is padding

Item = tuple[str, int, int, torch.Tensor]  # (run name, index in the run, prompt index, the generated tokens)


def reference(subject: Subject, prompts: list[torch.Tensor], items: list[Item], pad: int, seq2seq: bool,
              start_id: int | None) -> tuple[dict[tuple[str, int], torch.Tensor], list[torch.Tensor | None], float]:
    """Teacher-forced logits at the generated positions ([N, V]) of each generated row alone, each prompt's logits at
    its last position ([V]; None for a prompt no run generated from, decoder-only), and the measured noise floor
    (max per position over equivalent cache-free paths).

    Decoder-only: sequences of like length right-padded into one forward without a mask (a causal model never sees
    the keys after a query, so the padding is invisible), the short prompt prefixes likewise; logits only at the
    positions compared.
    Encoder-decoders: one forward per prompt (its unpadded encoder input), all its decoder
    sequences stacked; the prompt-only pass is the padded-encoder batch with its mask (prompts of like length
    together: length_groups).
    """
    if not seq2seq:
        return _decoder_reference(subject, prompts, items, pad)
    model, refs = subject.model, {}
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            mine = [(name, i, toks) for name, i, r, toks in items if r == row]
            if not mine:
                continue
            start = torch.full((1,), start_id, dtype=torch.long, device=subject.device)
            dec = torch.stack([torch.cat([start, toks[:-1]]) for _, _, toks in mine])
            subject.forward_count += 1
            out = output_of(model(input_ids=prompt[None].expand(len(mine), -1), decoder_input_ids=dec,
                                  use_cache=False, return_dict=True))
            for j, (name, i, _) in enumerate(mine):
                refs[(name, i)] = out[j]
        pout: list[torch.Tensor | None] = [None] * len(prompts)  # each prompt's first decoder logits
        for group in length_groups([len(p) for p in prompts]):
            enc, enc_mask = right_padded([prompts[j] for j in group], pad, subject.device)
            start = torch.full((len(group), 1), start_id, dtype=torch.long, device=subject.device)
            subject.forward_count += 1
            got = output_of(model(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=start,
                                  use_cache=False, return_dict=True))
            for g, j in enumerate(group):
                pout[j] = got[g, 0]
    floor = max(relative_l2(pout[row], refs[(name, i)][0]) for name, i, row, _ in items)
    return refs, pout, floor


def _decoder_reference(subject: Subject, prompts: list[torch.Tensor], items: list[Item],
                       pad: int) -> tuple[dict[tuple[str, int], torch.Tensor], list[torch.Tensor | None], float]:
    """`reference` for decoder-only models. The floor compares short prompt prefixes with the teacher-forced forward
    at up to FLOOR_POSITIONS positions spread over the prefix. Short prefixes: decode steps run at a small width, and
    so does this pass (measured on CPU: widths >= 16 reproduce a longer forward bit for bit, widths 1-8 do not)."""
    index: dict[tuple, int] = {}  # identical generations (dynamic and static caches usually agree) share one row
    seqs: list[torch.Tensor] = []
    owner: list[int] = []  # the prompt of each reference row
    for _, _, row, toks in items:
        key = (row, tuple(toks.tolist()))
        if key not in index:
            index[key] = len(seqs)
            seqs.append(torch.cat([prompts[row], toks[:-1]]))
            owner.append(row)
    steps = len(items[0][3])
    short = max(1, min(len(p) for p in prompts) // 2)
    spots = sorted({round(x) for x in torch.linspace(0, short - 1, min(short, FLOOR_POSITIONS)).tolist()})
    keep = [spots + list(range(len(prompts[r]) - 1, len(prompts[r]) - 1 + steps)) for r in owner]
    out = _logits_by_length(subject, seqs, keep, pad)  # each [F + N, V]
    refs = {(name, i): out[index[(row, tuple(toks.tolist()))]][len(spots):] for name, i, row, toks in items}
    # a prompt's last logits are its reference's first compared position (causal: the generated tokens after it
    # are not seen there), so no forward of the prompts alone is needed; a prompt without a generated row gets none
    first = {j: out[s][len(spots)] for s, j in reversed(list(enumerate(owner)))}
    return refs, [first.get(j) for j in range(len(prompts))], _prefix_floor(subject, prompts, owner, out, spots)


def _prefix_floor(subject: Subject, prompts: list[torch.Tensor], owner: list[int], out: list[torch.Tensor],
                  spots: list[int]) -> float:
    """The short prompt prefixes' logits at `spots` against each reference row's (`out`, of the prompt `owner`
    names), max per position."""
    prefixes = torch.stack([p[:spots[-1] + 1] for p in prompts])
    sout = logits_at(subject, prefixes, torch.tensor([spots] * len(prompts)))
    return max(relative_l2(sout[j, f], out[s][f]) for s, j in enumerate(owner) for f in range(len(spots)))


def _logits_by_length(subject: Subject, seqs: list[torch.Tensor], keep: list[list[int]],
                      pad: int) -> list[torch.Tensor]:
    """Cache-free logits of each sequence at its `keep` positions ([K, V] each). Sequences of like length share a
    right-padded forward without a mask (a causal model never sees the keys after a query, so the padding is
    invisible); one much shorter than the rest goes in another, so padding never multiplies the cost."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for group in length_groups([len(x) for x in seqs]):
        ids, _ = right_padded([seqs[j] for j in group], pad, seqs[0].device)
        got = logits_at(subject, ids, torch.tensor([keep[j] for j in group]))
        for g, j in enumerate(group):
            out[j] = got[g]
    return out


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the sequences grouped so that a right-padded forward of each group spends at most PADDING_SHARE of
    its tokens on padding: longest first, a sequence joining the group before it while that holds; each group in
    its original order."""
    groups: list[list[int]] = []
    for j in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        if groups:
            group = groups[-1]
            width = lengths[group[0]]
            if sum(lengths[k] for k in group) + lengths[j] >= (1 - PADDING_SHARE) * width * (len(group) + 1):
                group.append(j)
                continue
        groups.append([j])
    return [sorted(group) for group in groups]


def jitter_floor(subject: Subject, prompt: torch.Tensor, tokens: torch.Tensor, seed: int) -> float | None:
    """A degenerate floor (the prefixes reproduced the teacher-forced forward bit for bit) re-measured in the run
    dtype: a generated row's teacher-forced forward again with its token embeddings jittered by ~1 ulp, at the
    generated positions (the rounding sensitivity of what is compared); None where no embedding is found."""
    seq = torch.cat([prompt, tokens[:-1]])[None]
    where = torch.arange(len(prompt) - 1, seq.shape[1])[None]
    with jittered(subject, "decoder", 0, 1, seed, settle_masks=False) as found:
        shaken = logits_at(subject, seq, where)[0] if found else None
    if shaken is None:
        return None
    plain = logits_at(subject, seq, where)[0]
    return max(relative_l2(shaken[k], plain[k]) for k in range(plain.shape[0]))


def right_padded(seqs: list[torch.Tensor], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack sequences of different lengths, right-padded with `pad`; also the 0/1 attention mask."""
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for j, x in enumerate(seqs):
        ids[j, :len(x)], mask[j, :len(x)] = x, 1
    return ids, mask
