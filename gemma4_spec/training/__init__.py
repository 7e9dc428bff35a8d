"""Builds a small Gemma 4 target + assistant pair trained on GSM8k that actually drafts well.

Modules, one purpose each: ``tokenizer`` (BPE tokenizer with a Gemma-style chat template),
``corpus`` (GSM8k problems as chat-formatted token sequences), ``target`` (the target model and
its language-model training), ``features`` (the target's greedy continuations, hidden states and
shared K/V: the assistant's inputs at inference), ``assistant`` (the assistant and its unrolled
draft training), ``clustering`` (balanced k-means for the centroid head's ``token_ordering``) and
``build`` (the whole recipe, behind ``gemma4-spec build-gsm8k-pair``).
"""
