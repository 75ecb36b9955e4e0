"""Training forms of kvmem's learned memories (issue 45): differentiable PyTorch forwards that compute what
the C++ memories compute, so that parameters trained through them are exactly what kvmem runs.

- kvm: KVM's chunk-parallel prefill (kvm_prefill; also the proportional rule);
- ovq: OVQ's chunk-parallel prefill (ovq_prefill, dictionary_sizes);
- kvpop: KVPOP's learned eviction scorer, the delayed mLSTM scores of kvmem.EvictionMemory(scorer="kvpop") in
  their closed parallel form (mlstm_scores, effective_keys), the eviction policy's training mask and attention
  under it (keep_mask, masked_attention), the future-attention importance target (importance_target) and the
  pairwise boundary loss that trains the scorer (kvpop_loss, boundary_pairs);
- capture: what each attention layer of a transformers causal LM sees (its input, q, k, v);
- model: a causal LM with a training form in every layer (memories_in_every_layer);
- distill: per-layer (stage 1) and end-to-end (stage 2) fits of a memory's parameters, the model frozen.

Weights files of the trained parameters: kvmem.weights. The recipe on a real model: tools/distill/distill.py.
"""
