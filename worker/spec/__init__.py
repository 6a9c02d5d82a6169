"""Speculative decoding: draft proposers (proposer.py: the interface and the per-request draft budget;
ngram.py: prompt lookup) and the verifier (verifier.py: the target's seeded tokens over the draft positions
-> accepted drafts + one token of the target's own). The scheduler schedules drafts as tokens still to
compute and the model runner scores them in the step's one forward."""
